"""A critic in verl 0.9.1's separated trainers (one-step-off-policy, fully async): the two places where
verl's code fails before the first step, each replaced by what verl's own ``RayPPOTrainer`` does there
(records of :data:`verl_ext.touches.PLUGIN_TOUCHES`).

* ``SeparateRayPPOTrainer._create_critic_class`` (``verl/experimental/separation/ray_trainer.py:145``)
  takes the critic's engine config from ``critic.model.fsdp_config``, which 0.9.1's critic config does
  not have (``critic.model`` is an ``HFModelConfig``; the engine is ``critic.fsdp``, the dataclass's
  ``engine``): ``AttributeError`` for ``critic.strategy=fsdp`` (verl's default), ``NotImplementedError``
  for every other strategy (``fsdp2`` included). :func:`critic_class_from_engine_config` builds the
  critic's ``TrainingWorkerConfig`` from ``critic.engine``, as ``RayPPOTrainer.init_workers`` does
  (``verl/trainer/ppo/ray_trainer.py:797-835``).
* ``OneStepOffRayTrainer._init_models`` and ``FullyAsyncTrainer._init_models`` call
  ``critic_wg.init_model()``, which the critic's worker (``TrainingWorker``, the unified engine worker
  ``separation/utils.py`` maps the critic to) does not have: ``AttributeError``.
  :func:`critic_initialised_as_verls` initialises the critic's worker group as
  ``SeparateRayPPOTrainer._init_models`` and ``RayPPOTrainer.init_workers`` do (``reset``, then the value
  loss with the critic's config), and runs the rest of the subclass' method unchanged.

Nothing else of these trainers changes; without a critic both are verl's own.
"""

from __future__ import annotations

from typing import Any, Callable


def critic_class_from_engine_config(original: Callable[..., Any]) -> Callable[..., Any]:
    def _create_critic_class(self):
        if not self.use_critic:
            return
        from verl.single_controller.ray import RayClassWithInitArgs
        from verl.trainer.ppo.utils import Role
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.engine_workers import TrainingWorkerConfig

        resource_pool = self.resource_pool_manager.get_resource_pool(Role.Critic)
        critic_cfg = omega_conf_to_dataclass(self.config.critic)
        self.orig_critic_cfg = critic_cfg  # SeparateRayPPOTrainer._init_models' value loss reads it
        engine_config = critic_cfg.engine
        engine_config.infer_max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
        engine_config.max_token_len_per_gpu = critic_cfg.ppo_max_token_len_per_gpu
        profiler = self.config.critic.get("profiler", {})
        worker_config = TrainingWorkerConfig(
            model_type="value_model",
            model_config=critic_cfg.model,
            engine_config=engine_config,
            optimizer_config=critic_cfg.optim,
            checkpoint_config=critic_cfg.checkpoint,
            profiler_config=omega_conf_to_dataclass(profiler) if profiler else None,
        )
        critic_cls = RayClassWithInitArgs(cls=self.role_worker_mapping[Role.Critic], config=worker_config)
        self.resource_pool_to_cls[resource_pool][str(Role.Critic)] = critic_cls

    return _create_critic_class


def critic_initialised_as_verls(original: Callable[..., Any]) -> Callable[..., Any]:
    def _init_models(self):
        if not self.use_critic:
            return original(self)
        from functools import partial

        from verl.trainer.ppo.utils import Role
        from verl.workers.utils.losses import value_loss

        self.use_critic = False  # the subclass' own critic block (critic_wg.init_model()) is skipped
        try:
            original(self)
        finally:
            self.use_critic = True
        self.critic_wg = self.all_wg[str(Role.Critic)]
        self.critic_wg.reset()
        self.critic_wg.set_loss_fn(partial(value_loss, config=self.orig_critic_cfg))

    return _init_models

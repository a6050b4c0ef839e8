"""A critic in verl 0.9.1's separated trainers (one-step-off-policy, fully async): verl's own code fails
before step 1 in two places, and the plugin's touches (verl_ext.integration.separate_critic) build and
initialise the critic as verl's RayPPOTrainer does. Driven on stand-ins for the trainer's resource pools and
worker groups, without Ray; the runs (ASYNC=one_step_off and ASYNC=fully_async of recipes/cpu_demo.sh with
verl's gae) are measured in docs/cpu_backend.md."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest

from verl_ext.patching import ORIGINAL_ATTR


def critic_config(assets, strategy: str):
    from verl_ext.cpu.overrides import compose_config

    return compose_config([
        "algorithm.adv_estimator=gae", f"actor_rollout_ref.model.path={assets.model_dir}", f"critic.model.path={assets.model_dir}",
        f"critic.strategy={strategy}", "critic.ppo_micro_batch_size_per_gpu=4",
    ])  # fmt: skip


def trainer_stand_in(config):
    from verl.trainer.ppo.utils import Role

    pools = SimpleNamespace(get_resource_pool=lambda role: "trainer_pool")
    return SimpleNamespace(
        use_critic=True, config=config, resource_pool_manager=pools, role_worker_mapping={Role.Critic: "TrainingWorker"},
        resource_pool_to_cls={"trainer_pool": {}},
    )  # fmt: skip


@pytest.mark.parametrize("strategy, failure", [("fsdp", AttributeError), ("fsdp2", NotImplementedError)])
def test_the_critics_worker_config_comes_from_its_engine_config(assets, strategy, failure):
    from verl.experimental.separation.ray_trainer import SeparateRayPPOTrainer
    from verl.trainer.ppo.utils import Role

    patched = vars(SeparateRayPPOTrainer)["_create_critic_class"]
    verls = getattr(patched, ORIGINAL_ATTR)
    with pytest.raises(failure):  # critic.model.fsdp_config (absent in 0.9.1), or "Unknown strategy"
        verls(trainer_stand_in(critic_config(assets, strategy)))
    trainer = trainer_stand_in(critic_config(assets, strategy))
    patched(trainer)
    worker = trainer.resource_pool_to_cls["trainer_pool"][str(Role.Critic)]
    config = worker.kwargs["config"]
    assert worker.cls == "TrainingWorker" and config.model_type == "value_model"
    assert config.engine_config is trainer.orig_critic_cfg.engine and config.engine_config.strategy == strategy
    assert config.engine_config.max_token_len_per_gpu == trainer.orig_critic_cfg.ppo_max_token_len_per_gpu
    assert config.model_config.path == str(assets.model_dir) and config.optimizer_config is trainer.orig_critic_cfg.optim
    # without a critic nothing is made, as in verl
    trainer = trainer_stand_in(critic_config(assets, strategy))
    trainer.use_critic = False
    patched(trainer)
    assert trainer.resource_pool_to_cls == {"trainer_pool": {}}


class WorkerGroup:
    """A worker group's calls, recorded; it has the methods the worker class registers and no others."""

    def __init__(self, *methods: str):
        self.calls = []
        for method in methods:
            setattr(self, method, lambda *args, _m=method: self.calls.append((_m, args)))


def trainers():
    from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer
    from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer

    # the fully-async trainer runs as Ray's subclass of it, which holds its own copy of each method
    return {"one-step-off-policy": OneStepOffRayTrainer, "fully-async": FullyAsyncTrainer.__ray_metadata__.modified_class}


@pytest.mark.parametrize("mode", ["one-step-off-policy", "fully-async"])
def test_the_critics_worker_group_is_initialised_as_verls_trainer_does(mode):
    from verl.trainer.ppo.utils import Role
    from verl.workers.utils.losses import value_loss

    patched = vars(trainers()[mode])["_init_models"]
    verls = getattr(patched, ORIGINAL_ATTR)

    def stand_in():
        actor, critic = WorkerGroup("init_model"), WorkerGroup("reset", "set_loss_fn")  # TrainingWorker: no init_model
        return SimpleNamespace(
            use_critic=True, use_reference_policy=False, ref_in_actor=False, use_rm=False, train_role=Role.Actor,
            all_wg={str(Role.Actor): actor, str(Role.Critic): critic}, orig_critic_cfg=object(),
        ), actor, critic  # fmt: skip

    trainer, _, _ = stand_in()
    with pytest.raises(AttributeError, match="init_model"):
        verls(trainer)
    trainer, actor, critic = stand_in()
    patched(trainer)
    assert trainer.use_critic and trainer.critic_wg is critic and trainer.actor_wg is actor
    assert actor.calls == [("init_model", ())]
    assert [name for name, _ in critic.calls] == ["reset", "set_loss_fn"]
    loss = critic.calls[1][1][0]
    assert isinstance(loss, partial) and loss.func is value_loss and loss.keywords == {"config": trainer.orig_critic_cfg}

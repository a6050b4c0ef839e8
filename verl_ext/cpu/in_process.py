"""verl's real ``RayPPOTrainer.fit()`` in one process, without Ray: the fast path for tests.

Everything that computes is verl's own: ``RayPPOTrainer.fit()``, ``ActorRolloutRefWorker`` (actor,
reference, rollout adapter), ``TrainingWorker`` (critic), ``AgentLoopWorker``, ``RewardLoopWorker``
with the ``naive`` reward manager, the dataset and the dataloader. Only the plumbing that Ray
provides is replaced, by :class:`InProcessPPOTrainer.init_workers` (the counterpart of
``RayPPOTrainer.init_workers``):

* a one-rank gloo process group on an in-memory store, instead of one per Ray worker;
* :class:`InProcessWorkerGroup` for ``RayWorkerGroup`` (world size 1: dispatch and collect are the
  identity);
* verl's actor-like objects (agent-loop worker, reward-loop worker, load balancer, generation
  server) on one persistent event loop (:mod:`verl_ext.cpu.local_actor`), as inside Ray actors;
* :class:`InProcessWeightSync` for ``CheckpointEngineManager`` (the ``naive`` backend: the worker
  pushes its weights to the rollout directly).

With verl's vLLM rollout (``rollout.name=vllm``) the generation server is verl's own, a Ray actor:
this process joins the Ray cluster ``RAY_ADDRESS`` names or starts a small local one for it alone
(:func:`run_in_process`), and the replica is :class:`verl_ext.cpu.vllm_replica.LocalVLLMReplica`.

A test gets at what the trainer actually trained on through ``on_batch``: it is called once per
step with the batch after advantages and returns are computed, before the critic and actor updates
(see :class:`BatchRecorder`).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from functools import partial
from pathlib import Path
from typing import Any, Callable

import verl_ext.cpu

# The backend must be active before any verl import: verl resolves its device (when its FSDP engine
# module is imported) and binds the names the CPU backend patches (engine_workers.py imports
# initialize_global_process_group_ray) at import time. Importing this module never activates it.
if not verl_ext.cpu.is_active():
    raise ImportError(
        "verl_ext.cpu.in_process runs verl's trainer on the CPU backend, which is not active: call "
        "verl_ext.cpu.activate() (or set VERL_EXT_CPU=1 and import verl) before importing this module"
    )

import hydra  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.experimental.agent_loop import AgentLoopManager  # noqa: E402
from verl.experimental.agent_loop.agent_loop import (  # noqa: E402
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
)
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop  # noqa: E402
from verl.experimental.reward_loop.reward_loop import RewardLoopWorker  # noqa: E402
from verl.single_controller.base.decorator import MAGIC_ATTR  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer  # noqa: E402
from verl.trainer.ppo.utils import (  # noqa: E402
    Role,
    create_rl_dataset,
    create_rl_sampler,
    need_critic,
    need_reference_policy,
)
from verl.utils.config import omega_conf_to_dataclass, validate_config  # noqa: E402
from verl.utils.rollout_trace import rollout_trace_attr  # noqa: E402
from verl.workers.rollout.llm_server import LLMServerManager  # noqa: E402
from verl.workers.rollout.router import DEFAULT_ROUTING_CACHE_SIZE, GlobalRequestLoadBalancer  # noqa: E402

from verl_ext.cpu.local_actor import LocalActorHandle, actor_loop  # noqa: E402
from verl_ext.cpu.vllm_rollout import VLLM  # noqa: E402
from verl_ext.hf_rollout.server import HFGenerationServer, HFReplica, register_local_server  # noqa: E402

#: Called once per step: ``on_batch(step, batch, trainer)``; ``batch`` is the trainer's live batch.
BatchHook = Callable[[int, DataProto, "InProcessPPOTrainer"], None]


class _Ready:
    """A finished result with ``.get()``, as verl's non-blocking worker-group calls return."""

    def __init__(self, value: Any):
        self._value = value

    def get(self) -> Any:
        return self._value


class InProcessWorkerGroup:
    """``RayWorkerGroup``'s interface over one worker object in this process.

    Only the worker's ``@register``-ed methods are exposed, as on a real worker group. With one rank
    verl's dispatch functions split nothing and its collect functions gather one output, so a call is
    the method call itself; ``ONE_TO_ALL``-style methods return a one-element list, non-blocking
    methods an object with ``.get()``, and ``async`` methods run on the actor loop.
    """

    world_size = 1

    def __init__(self, worker: Any):
        self.worker = worker
        self.workers = [worker]
        self._dispatch_info: dict[str, list[int]] = {}

    def __getattr__(self, name: str):
        method = getattr(self.worker, name)
        attrs = getattr(method, MAGIC_ATTR, None)
        if attrs is None:
            raise AttributeError(f"{type(self.worker).__name__}.{name} is not a registered worker-group method")
        per_rank_list = not isinstance(attrs["dispatch_mode"], dict)  # nd-compute dispatch returns the output

        def call(*args, **kwargs):
            if inspect.iscoroutinefunction(method):
                result = actor_loop().call(method, *args, **kwargs)
            else:
                result = method(*args, **kwargs)
            if per_rank_list:
                result = [result]
            return result if attrs["blocking"] else _Ready(result)

        return call


class InProcessWeightSync:
    """``CheckpointEngineManager`` with the ``naive`` backend, for an in-process worker."""

    def __init__(self, actor_rollout_wg: InProcessWorkerGroup, replicas: list):
        self.actor_rollout_wg = actor_rollout_wg
        self.replicas = replicas

    def update_weights(self, global_steps: int | None = None) -> dict:
        self.actor_rollout_wg.update_weights(global_steps=global_steps, mode="naive")
        return {}

    def sleep_replicas(self) -> None:
        async def sleep_all():
            await asyncio.gather(*[replica.sleep() for replica in self.replicas])

        actor_loop().call(sleep_all)


class LocalHFReplica(HFReplica):
    """The ``hf`` replica with its generation server on the actor loop instead of a Ray actor."""

    async def launch_servers(self):
        loop = actor_loop()
        instance = await asyncio.wrap_future(
            loop.submit(HFGenerationServer, self.model_path(), self.config, self.replica_rank)
        )
        server = LocalActorHandle(instance, loop)
        register_local_server(self.replica_rank, server)
        self._attach(server)


class InProcessLLMServerManager(LLMServerManager):
    rollout_replica_class = LocalHFReplica  # verl's hook "for recipe to change" (llm_server.py)

    async def _init_global_load_balancer(self) -> None:
        self.global_load_balancer = LocalActorHandle.create(
            GlobalRequestLoadBalancer,
            servers=dict(zip(self.server_addresses, self.server_handles, strict=True)),
            max_cache_size=DEFAULT_ROUTING_CACHE_SIZE,
        )


class InProcessVLLMServerManager(InProcessLLMServerManager):
    """The in-process manager of verl's vLLM servers (Ray actors: verl's own replica, whose workers
    are this process')."""

    def __init__(self, *args, **kwargs):
        from verl_ext.cpu.vllm_replica import LocalVLLMReplica  # imports vLLM: only for a vLLM run

        self.rollout_replica_class = LocalVLLMReplica
        super().__init__(*args, **kwargs)


class InProcessAgentLoopWorker(AgentLoopWorker):
    """verl's agent-loop worker, building a single-turn agent loop once instead of once per sample.

    verl instantiates the agent loop of every sample through ``hydra.utils.instantiate``
    (in ``AgentLoopWorker._run_agent_loop``), which merges its arguments into an OmegaConf node: ~3 ms a sample, 0.4 s of
    each 128-response step on a CPU. ``SingleTurnAgentLoop`` keeps nothing of a sample between runs
    (its state is the config, the server client and a stateless token builder), so one instance
    serves them all; any other agent loop is still built per sample, as verl does.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._reusable_agent_loops: dict[str, SingleTurnAgentLoop] = {}

    async def _run_agent_loop(self, sampling_params, trajectory, *, agent_name, trace=True, **kwargs):
        # verl's ``AgentLoopWorker._run_agent_loop`` with the agent loop from _agent_loop
        with rollout_trace_attr(
            step=trajectory["step"],
            sample_index=trajectory["sample_index"],
            rollout_n=trajectory["rollout_n"],
            validate=trajectory["validate"],
            name="agent_loop",
            trace=trace,
        ):
            output = await self._agent_loop(agent_name).run(sampling_params, **kwargs)
            return await self._agent_loop_postprocess(output, trajectory["validate"], **kwargs)

    def _agent_loop(self, agent_name: str):
        if agent_name in self._reusable_agent_loops:
            return self._reusable_agent_loops[agent_name]
        if agent_name not in _agent_loop_registry:
            raise ValueError(f"Agent loop {agent_name} not registered, registered agent loops: {_agent_loop_registry.keys()}")
        agent_loop = hydra.utils.instantiate(
            config=_agent_loop_registry[agent_name],
            trainer_config=DictConfigWrap(config=self.config),
            server_manager=self.llm_client,
            tokenizer=self.tokenizer,
            processor=self.processor,
            hf_model_type=self.hf_model_type,
            dataset_cls=self.dataset_cls,
            data_config=DictConfigWrap(self.config.data),
            tools=ToolListWrap(self.tools),
        )
        if type(agent_loop) is SingleTurnAgentLoop:
            self._reusable_agent_loops[agent_name] = agent_loop
        return agent_loop


class InProcessAgentLoopManager(AgentLoopManager):
    async def _init_agent_loop_workers(self):
        self.agent_loop_workers = [
            LocalActorHandle.create(
                InProcessAgentLoopWorker, self.config, self.llm_client, self.teacher_client, self.reward_loop_worker_handles
            )
            for _ in range(self.rollout_config.agent.num_workers)
        ]


class _OneDevice:
    """What fit() asks of the resource pool manager: the device count for throughput metrics."""

    def get_n_gpus(self) -> int:
        return 1


class InProcessPPOTrainer(RayPPOTrainer):
    """verl's legacy trainer with its workers built in this process (see the module docstring)."""

    def __init__(self, *args, on_batch: BatchHook | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_batch = on_batch
        self._hooked_step: int | None = None

    def init_workers(self):
        init_single_rank_process_group()
        actor_role = Role.ActorRolloutRef if Role.ActorRolloutRef in self.role_worker_mapping else Role.ActorRollout
        if self.use_critic:
            self.critic_wg = critic_worker_group(self.config)
        self.actor_rollout_wg = actor_worker_group(self.config, str(actor_role))
        if self.use_reference_policy:
            self.ref_policy_wg = self.actor_rollout_wg  # the reference model lives in the same worker

        self.reward_loop_manager = None  # only used with a reward model
        reward_loop_workers = [
            LocalActorHandle.create(RewardLoopWorker, self.config, None) for _ in range(self.config.reward.num_workers)
        ]
        self.async_rollout_mode = True
        self.teacher_model_manager = None
        self.distillation_config = None
        vllm = self.config.actor_rollout_ref.rollout.name == VLLM
        manager = InProcessVLLMServerManager if vllm else InProcessLLMServerManager
        self.llm_server_manager = manager.create(config=self.config, worker_group=self.actor_rollout_wg)
        self.async_rollout_manager = InProcessAgentLoopManager.create(
            config=self.config,
            llm_client=self.llm_server_manager.get_client(),
            teacher_client=None,
            reward_loop_worker_handles=reward_loop_workers,
        )
        self.checkpoint_manager = InProcessWeightSync(self.actor_rollout_wg, self.llm_server_manager.get_replicas())
        self.checkpoint_manager.sleep_replicas()

    def _validate(self, *args, **kwargs):
        """verl's validation, its rollouts sampled from their own random streams (see
        ``HFGenerationServer.use_stream``): how often a run validates does not change its training."""
        self._use_stream("validation")
        try:
            return super()._validate(*args, **kwargs)
        finally:
            self._use_stream("training")

    def _use_stream(self, name: str) -> None:
        for replica in self.llm_server_manager.get_replicas():
            if not isinstance(replica, LocalHFReplica):  # vLLM samples from its engine's own stream
                continue
            for server in replica.servers:
                server.use_stream.remote(name).result()

    # The step hook: _update_critic runs right after compute_advantage when there is a critic,
    # _update_actor otherwise; whichever comes first in a step reports the batch.
    def _update_critic(self, batch: DataProto) -> DataProto:
        self._report_batch(batch)
        return super()._update_critic(batch)

    def _update_actor(self, batch: DataProto) -> DataProto:
        self._report_batch(batch)
        return super()._update_actor(batch)

    def _report_batch(self, batch: DataProto) -> None:
        if self.on_batch is not None and self._hooked_step != self.global_steps:
            self._hooked_step = self.global_steps
            self.on_batch(self.global_steps, batch, self)


def critic_worker_group(config: DictConfig) -> InProcessWorkerGroup:
    """verl's critic ``TrainingWorker``, reset, with verl's value loss: as RayPPOTrainer.init_workers builds it."""
    from verl.workers.config import CriticConfig
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import value_loss

    critic_cfg: CriticConfig = omega_conf_to_dataclass(config.critic)
    engine_config = critic_cfg.engine
    engine_config.infer_max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    engine_config.max_token_len_per_gpu = critic_cfg.ppo_max_token_len_per_gpu
    critic_worker = TrainingWorker(
        config=TrainingWorkerConfig(
            model_type="value_model",
            model_config=critic_cfg.model,
            engine_config=engine_config,
            optimizer_config=critic_cfg.optim,
            checkpoint_config=critic_cfg.checkpoint,
        )
    )
    group = InProcessWorkerGroup(critic_worker)
    group.reset()
    group.set_loss_fn(partial(value_loss, config=critic_cfg))
    return group


def actor_worker_group(config: DictConfig, role: str) -> InProcessWorkerGroup:
    """verl's ``ActorRolloutRefWorker`` in ``role`` ("actor": the actor alone), its model built."""
    from verl.workers.engine_workers import ActorRolloutRefWorker

    group = InProcessWorkerGroup(
        ActorRolloutRefWorker(config=config.actor_rollout_ref, distillation_config=config.get("distillation"), role=role)
    )
    group.init_model()
    return group


def init_single_rank_process_group() -> None:
    """A one-rank gloo group on an in-memory store (no port), plus the env verl's Worker reads."""
    os.environ.update(
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "RAY_LOCAL_WORLD_SIZE": "1"}
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "0")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)


def build_trainer(config: DictConfig, on_batch: BatchHook | None = None) -> InProcessPPOTrainer:
    """What ``main_ppo.main`` and ``main_ppo_v0.TaskRunner.run`` do up to ``init_workers()``, without Ray."""
    from verl.utils.dataset.rl_dataset import collate_fn
    from verl.utils.device import auto_set_device
    from verl.workers.config import HFModelConfig
    from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    OmegaConf.resolve(config)
    role_worker_mapping = {
        (Role.ActorRolloutRef if need_reference_policy(config) else Role.ActorRollout): ActorRolloutRefWorker,
        Role.Critic: TrainingWorker,
    }
    model_config: HFModelConfig = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    tokenizer, processor = model_config.tokenizer, model_config.processor
    train_dataset = create_rl_dataset(config.data.train_files, config.data, tokenizer, processor, is_train=True)
    val_dataset = create_rl_dataset(config.data.val_files, config.data, tokenizer, processor, is_train=False)
    return InProcessPPOTrainer(
        config=config,
        tokenizer=tokenizer,
        processor=processor,
        role_worker_mapping=role_worker_mapping,
        resource_pool_manager=_OneDevice(),
        train_dataset=train_dataset,
        val_dataset=val_dataset,
        collate_fn=collate_fn,
        train_sampler=create_rl_sampler(config.data, train_dataset),
        on_batch=on_batch,
    )


def run_in_process(
    overrides: list[str],
    on_batch: BatchHook | None = None,
    config_dir: str | os.PathLike | None = None,
    config_name: str = "ppo_trainer",
) -> InProcessPPOTrainer:
    """Compose the config (see :func:`compose_config`), build the trainer and its workers here, run ``fit()``.

    The CPU backend is active in this process (importing this module activates it). The platform,
    the registries and the patches are process-global: run one scenario per process.
    """
    from verl_ext.cpu.overrides import compose_config

    config = compose_config(overrides, config_dir, config_name)
    if config.actor_rollout_ref.rollout.name == VLLM:
        _join_ray_for_the_vllm_server(Path(config.trainer.default_local_dir).parent)
    if "file" in config.trainer.logger and "VERL_FILE_LOGGER_PATH" not in os.environ:
        # verl's file logger would write to ./<project>/<experiment>.jsonl; put it next to the
        # checkpoints instead, where cpu_environment() puts it for a run on Ray.
        from verl_ext.cpu.overrides import METRICS_FILE

        output_dir = Path(config.trainer.default_local_dir).parent
        output_dir.mkdir(parents=True, exist_ok=True)
        os.environ["VERL_FILE_LOGGER_PATH"] = str(output_dir / METRICS_FILE)
    trainer = build_trainer(config, on_batch=on_batch)
    trainer.init_workers()
    trainer.fit()
    return trainer


def _join_ray_for_the_vllm_server(output_dir: Path) -> None:
    """Ray for verl's vLLM server actor (its engine is a process of its own): the cluster ``RAY_ADDRESS``
    names, else a local one for the server alone; the server's processes get the CPU run's environment."""
    import ray

    from verl_ext.cpu.overrides import cpu_environment

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    cluster = {"address": address} if address else {"num_cpus": 2, "num_gpus": 0, "include_dashboard": False}
    ray.init(**cluster, runtime_env={"env_vars": cpu_environment(output_dir)}, configure_logging=False)


class BatchRecorder:
    """An ``on_batch`` hook that keeps a CPU copy of each step's batch tensors and of the KL coefficient."""

    def __init__(self, keys: list[str] | None = None):
        self.keys = keys
        self.steps: dict[int, dict[str, Any]] = {}

    def __call__(self, step: int, batch: DataProto, trainer: InProcessPPOTrainer) -> None:
        keys = self.keys if self.keys is not None else list(batch.batch.keys())
        record: dict[str, Any] = {key: batch.batch[key].detach().clone() for key in keys if key in batch.batch.keys()}
        kl_controller = getattr(trainer, "kl_ctrl_in_reward", None)
        # apply_kl_penalty updates the controller after using it; the fixed controller never changes.
        record["kl_coef"] = kl_controller.value if kl_controller is not None else None
        record["uid"] = list(batch.non_tensor_batch.get("uid", []))
        self.steps[step] = record


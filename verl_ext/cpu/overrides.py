"""The hydra overrides and environment that make verl's own ``ppo_trainer.yaml`` a CPU run.

One list serves the real CLI (``python -m verl.trainer.main_ppo <overrides>``), the in-process
runner and the tests. Every entry is there for a reason given next to it; what verl cannot be
configured into is patched instead (:mod:`verl_ext.cpu.patches`).

The model, prompts and reward come from a task's assets (:class:`RunAssets`; the example task's
are :func:`verl_ext.tasks.arith.assets.build_assets`). From a shell, one override per line
(``recipes/cpu_demo.sh`` reads them with ``mapfile``)::

    python -m verl_ext.apps.overrides --output-dir outputs/cpu --steps 5 --estimator gae

verl 0.9.1's asynchronous trainers (:data:`ASYNC_MODES`) need more on a CPU: :func:`async_overrides`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from verl_ext.cpu import CPU_PROCESS_ENV, ENV_SWITCH, ROLLOUT_NAME
from verl_ext.errors import UsageError
from verl_ext.cpu.vllm_rollout import VLLM, VLLM_CPU_ENV, vllm_overrides
from verl_ext.options import STOP_FILE, STOP_FILE_ENV

if TYPE_CHECKING:
    from omegaconf import DictConfig

METRICS_FILE = "metrics.jsonl"

#: The backend's precisions: ``fp32`` forces full fp32 everywhere (exact values and log-probs, and
#: fast on any CPU); ``bf16`` leaves verl's mixed precision unset, as a GPU run has it: bf16
#: parameters and autocast, fp32 reduce and buffers (verl's ``FSDPEngine._build_fsdp_module``).
PRECISIONS = ("fp32", "bf16")
#: The rollouts a CPU run can generate with: verl-ext's HF-generate server (the default: fast to start,
#: sampled per request) or verl's own vLLM server on vLLM's CPU build (verl_ext.cpu.vllm_rollout).
ROLLOUTS = (ROLLOUT_NAME, VLLM)

#: verl 0.9.1's asynchronous trainers: V1's mode with the rollout on workers of its own
#: (``trainer.v1.trainer_mode=separate_async``, through ``python -m verl.trainer.main_ppo``), and the two
#: experimental trainers, each with its own entry point and config (:data:`EXPERIMENTAL_TRAINERS`).
SEPARATE_ASYNC = "separate_async"
ONE_STEP_OFF = "one_step_off"
FULLY_ASYNC = "fully_async"
ASYNC_MODES = (SEPARATE_ASYNC, ONE_STEP_OFF, FULLY_ASYNC)
#: mode -> (the module ``python -m`` runs, the package whose ``config/`` holds its hydra config, the config's name)
EXPERIMENTAL_TRAINERS = {
    ONE_STEP_OFF: (
        "verl.experimental.one_step_off_policy.main_ppo", "verl.experimental.one_step_off_policy", "one_step_off_ppo_trainer",
    ),
    FULLY_ASYNC: (
        "verl.experimental.fully_async_policy.fully_async_main", "verl.experimental.fully_async_policy", "fully_async_ppo_trainer",
    ),
}  # fmt: skip
#: The entry point of a run that is none of them.
MAIN_PPO = "verl.trainer.main_ppo"
#: The checkpoint engine that sends the trainer's weights to a rollout on workers of its own, on a CPU
#: (verl_ext.cpu.checkpoint_engine; the names are repeated here so that this module imports no verl).
CHECKPOINT_ENGINE = "verl_ext_shm"
CHECKPOINT_ENGINE_MODULE = "verl_ext.cpu.checkpoint_engine"


def add_precision_argument(parser, help_prefix: str = "") -> None:
    """The ``--precision`` option of every command that makes a CPU run (one choice list, one default)."""
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="fp32",
        help=f"{help_prefix}fp32 everywhere (default), or bf16: verl's GPU mixed precision",
    )  # fmt: skip


def add_rollout_argument(parser, default: str = ROLLOUT_NAME) -> None:
    """The ``--rollout`` option of every command that makes a CPU run (``default``: what it runs without one)."""
    parser.add_argument(
        "--rollout", choices=ROLLOUTS, default=default,
        help=f"what generates the responses: {ROLLOUT_NAME} (verl-ext's HF-generate server) or {VLLM} (verl's own "
        f"vLLM server, on vLLM's CPU build); default here {default}",
    )  # fmt: skip


def engine_rollout() -> str:
    """The rollout real runs use where it can run here: verl's vLLM server where vLLM's CPU build is
    installed (``make setup`` installs it), else verl-ext's HF-generate server."""
    from verl_ext.cpu.vllm_rollout import cpu_build_installed

    return VLLM if cpu_build_installed() else ROLLOUT_NAME


class RunAssets(Protocol):
    """What a CPU run needs from a task: a model directory (weights and tokenizer), verl's
    RLHFDataset parquet files, a reward function verl loads by path, and the longest prompt.
    A task whose runs need more settings (verl's tool agent loop) lists them as ``overrides``."""

    max_prompt_length: int
    model_dir: Path
    train_file: Path
    val_file: Path
    reward_file: Path
    reward_name: str


def cpu_environment(output_dir: str | os.PathLike) -> dict[str, str]:
    """Environment variables of a CPU run: the switch, offline hubs, verl's metrics file, the run's
    stop file (:mod:`verl_ext.stopping`), the size of a vLLM server's KV cache (read by
    vLLM's CPU build only), and the user's modules' directory (:func:`user_modules_path`)."""
    return {
        ENV_SWITCH: "1",
        **CPU_PROCESS_ENV,
        **VLLM_CPU_ENV,
        # verl's "file" logger (trainer.logger) writes one JSON line of metrics per step here
        "VERL_FILE_LOGGER_PATH": str(Path(output_dir).resolve() / METRICS_FILE),
        # the run stops between two steps once this file exists (verl-ext's commands create it on Ctrl-C)
        STOP_FILE_ENV: str(Path(output_dir).resolve() / STOP_FILE),
        **user_modules_path(),
    }


def user_modules_path(environ: dict[str, str] | None = None, start: str | os.PathLike | None = None) -> dict[str, str]:
    """``{"PYTHONPATH": ...}`` with ``start`` (default: this process' working directory, where the
    user started the command) first, when ``VERL_USE_EXTERNAL_MODULES`` names modules for verl to
    import in every process of a run; else ``{}``. ``python my_script.py`` or ``python -m`` finds a
    module beside the user; a trainer that runs in its output directory, or a Ray worker that runs in
    Ray's, would not."""
    from verl_ext.options import EXTERNAL_MODULES

    environ = os.environ if environ is None else environ
    if not environ.get(EXTERNAL_MODULES, "").strip():
        return {}
    first = str(Path(start if start is not None else os.getcwd()).resolve())
    rest = [entry for entry in environ.get("PYTHONPATH", "").split(os.pathsep) if entry and entry != first]
    return {"PYTHONPATH": os.pathsep.join([first, *rest])}


def cpu_overrides(
    assets: RunAssets,
    output_dir: str | os.PathLike,
    *,
    steps: int = 2,
    estimator: str = "gae",
    train_batch_size: int = 8,
    rollout_n: int = 1,
    response_length: int = 16,
    use_v1: bool = False,
    use_ray: bool = True,
    ray_address: str | None = None,
    seed: int = 0,
    precision: str = "fp32",
    rollout: str = ROLLOUT_NAME,
) -> list[str]:
    """Overrides for ``steps`` PPO steps of ``estimator`` on CPU; checkpoints go under ``output_dir``.

    ``use_ray=False`` leaves out the Ray-only settings (the in-process runner starts no Ray).
    ``ray_address``: join that running Ray cluster (its nodes declare their own CPUs and logical
    GPUs) instead of starting a local one. ``seed``: the data order, the rollout's sampling and the
    critic's fresh value head (``critic.fsdp.seed``, which the CPU backend seeds it from: touches.py).
    ``rollout``: one of :data:`ROLLOUTS` (verl's vLLM server is a Ray actor; without ``use_ray`` the
    in-process runner joins or starts a Ray cluster for it alone).
    Adjust the result with :func:`merge_overrides` (hydra rejects a key given twice).
    """
    check_precision(precision)
    if rollout not in ROLLOUTS:
        raise ValueError(f"rollout {rollout!r}: expected one of {', '.join(ROLLOUTS)}")
    output = Path(output_dir).resolve()
    micro_batch = train_batch_size * rollout_n  # one micro-batch per step: fewest forward passes
    overrides = [
        f"algorithm.adv_estimator={estimator}",
        # data: the task's generated prompts
        f"data.train_files={assets.train_file}",
        f"data.val_files={assets.val_file}",
        f"data.train_batch_size={train_batch_size}",
        f"data.max_prompt_length={assets.max_prompt_length}",
        f"data.max_response_length={response_length}",
        "data.dataloader_num_workers=0",  # no loader subprocesses on a 2-core machine
        f"data.seed={seed}",
        # model: the tiny llama; sdpa attention (verl's default, flash_attention_2, needs CUDA)
        f"actor_rollout_ref.model.path={assets.model_dir}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        # padded, as every figure of the demos was measured; packed sequences (True) run too: with sdpa,
        # transformers masks each sequence apart by its position ids (tests/e2e/gpu_world.py)
        "actor_rollout_ref.model.use_remove_padding=False",
        # actor and reference: FSDP2 (FSDP1 passes an integer CUDA device_id), no torch.compile
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
        *_precision("actor_rollout_ref.actor.fsdp_config", precision),
        *_precision("actor_rollout_ref.ref.fsdp_config", precision),
        f"actor_rollout_ref.actor.ppo_mini_batch_size={train_batch_size}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro_batch}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro_batch}",
        "actor_rollout_ref.actor.optim.lr=3e-4",
        # rollout: the HF-generate backend (verl_ext.hf_rollout), one replica, one agent-loop worker
        f"actor_rollout_ref.rollout.name={ROLLOUT_NAME}",
        f"actor_rollout_ref.rollout.n={rollout_n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro_batch}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        # request ids det-<index>: the hf rollout then samples each from a stream seeded by the id
        "actor_rollout_ref.rollout.full_determinism=True",
        f"actor_rollout_ref.rollout.seed={seed}",
        # critic: the same tiny model with a value head, the same CPU settings
        f"critic.model.path={assets.model_dir}",
        "+critic.model.override_config.attn_implementation=sdpa",
        "critic.model.use_remove_padding=False",
        "critic.strategy=fsdp2",
        "critic.fsdp.use_torch_compile=False",
        # the value head the checkpoint lacks is drawn from this seed (verl_ext.cpu.patches.value_model_seeded);
        # a learning run seeds torch with it too, so its head is the one it drew before the CPU backend seeded it
        f"critic.fsdp.seed={seed}",
        *_precision("critic.fsdp", precision),
        f"critic.ppo_micro_batch_size_per_gpu={micro_batch}",
        "critic.optim.lr=1e-3",
        # reward: the task's rule-based reward, one reward-loop worker
        f"reward.custom_reward_function.path={assets.reward_file}",
        f"reward.custom_reward_function.name={assets.reward_name}",
        "reward.num_workers=1",
        # trainer: one logical device, a fixed number of steps, metrics to a local file
        "trainer.device=cpu",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=1",
        f"trainer.total_training_steps={steps}",
        "trainer.logger=[console,file]",
        "trainer.project_name=verl_ext_cpu",
        f"trainer.experiment_name={estimator}",
        f"trainer.default_local_dir={output / 'checkpoints'}",
        f"trainer.use_v1={use_v1}",
        # V1 only: one TransferQueue storage actor instead of 8 (each reserves a Ray CPU)
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]
    if rollout == VLLM:
        overrides = merge_overrides(overrides, vllm_overrides(precision))
    overrides = merge_overrides(overrides, list(getattr(assets, "overrides", ())))
    if use_ray and ray_address is not None:
        overrides.append(f"+ray_kwargs.ray_init.address={ray_address}")
    elif use_ray:
        overrides += [
            # verl's ResourcePoolManager counts Ray GPU resources: declare one logical GPU.
            "+ray_kwargs.ray_init.num_gpus=1",
            # Logical CPUs for scheduling only: every verl actor reserves one (task runner, agent
            # loop, reward loop, load balancer, TransferQueue controller and storage).
            "ray_kwargs.ray_init.num_cpus=8",
            "+ray_kwargs.ray_init.include_dashboard=False",  # one process and ~0.5 GiB less
        ]
    if use_ray:
        overrides += [
            # The CPU switch and the metrics path reach every actor, also on a pre-started cluster
            # (quoted: Ray wants string values, hydra would read "1" as an int).
            *(
                f"+ray_kwargs.ray_init.runtime_env.env_vars.{name}='{value}'"
                for name, value in cpu_environment(output).items()
            ),
        ]
    return overrides


def async_overrides(
    mode: str,
    *,
    steps: int = 2,
    train_batch_size: int = 8,
    rollout_n: int = 1,
    parameter_sync_step: int = 4,
    trigger_parameter_sync_step: int = 1,
    use_ray: bool = True,
    ray_address: str | None = None,
) -> list[str]:
    """What one of verl's asynchronous trainers (:data:`ASYNC_MODES`) needs on a CPU, beyond
    :func:`cpu_overrides`; merge them after it (:func:`merge_overrides`), the user's own last.

    Every mode keeps its rollout on workers of its own: one logical GPU for the trainer and one for the
    rollout (verl's asserts: ``nnodes must be > 0``), and the weights go to the rollout through a checkpoint
    engine that runs on a CPU (:mod:`verl_ext.cpu.checkpoint_engine`; verl's ``nccl`` needs a GPU).

    * ``separate_async`` (V1): ``parameter_sync_step`` local updates per step (verl's default 4), each on
      ``train_batch_size / parameter_sync_step`` prompts: the actor's mini-batch (verl asserts
      ``train_batch_size == parameter_sync_step * ppo_mini_batch_size``) and every micro-batch that size
      (a micro-batch larger than the batch a local update sees fails verl's ``prepare_micro_batches``).
    * ``one_step_off``: verl's experimental trainer (``python -m`` :data:`EXPERIMENTAL_TRAINERS`), whose
      yaml names verl's config by a path (``file://verl/trainer/config``) that resolves only in verl's
      source checkout: the package instead; no hybrid engine (its trainer asserts it); its task runner
      reserves 10 logical CPUs. Its yaml sets the rest (rollout log-probs, bypass mode).
    * ``fully_async``: verl's experimental trainer; its rollouter takes one prompt at a time
      (``data.train_batch_size=0``, asserted), an update takes ``train_batch_size`` prompts (the actor's
      mini-batch), and after ``trigger_parameter_sync_step`` updates (1 here: verl's default is 4) the
      weights go to the rollout; ``steps`` such weight versions (``rollout.total_rollout_steps``, the
      prompts the rollouter feeds). Its trainer and rollouter reserve 10 logical CPUs each.
      ``async_training.staleness_threshold`` stays verl's (0.1: with it no sample is generated by weights
      older than the trainer's; 1 lets the rollouter run one version ahead).
    """
    if mode not in ASYNC_MODES:
        raise ValueError(f"asynchronous mode {mode!r}: expected one of {', '.join(ASYNC_MODES)}")
    rollout = "actor_rollout_ref.rollout"
    overrides = [
        f"{rollout}.nnodes=1",
        f"{rollout}.n_gpus_per_node=1",
        f"{rollout}.checkpoint_engine.backend={CHECKPOINT_ENGINE}",
        f"{rollout}.checkpoint_engine.custom_backend_module={CHECKPOINT_ENGINE_MODULE}",
    ]
    if mode == SEPARATE_ASYNC:
        per_update = train_batch_size // parameter_sync_step
        overrides += [f"actor_rollout_ref.actor.ppo_mini_batch_size={per_update}", *_micro_batches(per_update * rollout_n)]
    else:
        # the experimental trainers' own resource keys for the rollout (their main copies them into actor_rollout_ref.rollout)
        overrides += ["actor_rollout_ref.hybrid_engine=False", "rollout.nnodes=1", "rollout.n_gpus_per_node=1"]
    if mode == ONE_STEP_OFF:
        overrides.insert(0, "hydra.searchpath=[pkg://verl.trainer.config]")
    if mode == FULLY_ASYNC:
        overrides += [
            "data.train_batch_size=0",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={train_batch_size}",
            *_micro_batches(train_batch_size * rollout_n),
            f"async_training.trigger_parameter_sync_step={trigger_parameter_sync_step}",
            f"rollout.total_rollout_steps={steps * train_batch_size * trigger_parameter_sync_step}",
        ]
    if use_ray and ray_address is None:
        overrides += [
            "+ray_kwargs.ray_init.num_gpus=2",  # the trainer's and the rollout's logical GPU
            f"ray_kwargs.ray_init.num_cpus={ASYNC_RAY_CPUS[mode]}",
        ]
    return overrides


#: Logical CPUs a local Ray cluster declares for each mode (scheduling only): the 8 of a CPU run, or what the
#: experimental trainers' actors reserve (task runner 10; trainer and rollouter 10 each) and the workers beside them.
ASYNC_RAY_CPUS = {SEPARATE_ASYNC: 8, ONE_STEP_OFF: 16, FULLY_ASYNC: 32}


def _micro_batches(size: int) -> list[str]:
    return [
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={size}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={size}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={size}",
        f"critic.ppo_micro_batch_size_per_gpu={size}",
    ]


def separate_async_steps(config) -> int | None:
    """The local updates per step of a V1 run in ``separate_async`` mode (``parameter_sync_step``), read from
    its composed ``config``; None when the run is not in that mode. UsageError, one line: a
    ``parameter_sync_step`` that does not divide the train batch, or the mode without the V1 trainer (verl's
    legacy trainer ignores ``trainer.v1``)."""
    trainer = config.trainer
    if trainer.v1.trainer_mode != SEPARATE_ASYNC:
        return None
    if not trainer.use_v1:
        raise UsageError(
            f"trainer.v1.trainer_mode={SEPARATE_ASYNC} is a mode of verl's V1 trainer, which this run does not use: "
            "add trainer.use_v1=True (V1=1 for recipes/cpu_demo.sh)"
        )
    steps = int(trainer.v1.separate_async.parameter_sync_step)
    batch = int(config.data.train_batch_size)
    if steps < 1 or batch % steps:
        raise UsageError(
            f"trainer.v1.separate_async.parameter_sync_step={steps} must divide data.train_batch_size={batch}: each of "
            "its local updates takes an equal share of the batch"
        )
    return steps


def check_separate_async(config) -> None:
    """UsageError, one line, where verl's separate_async trainer would assert in its constructor: the actor's
    mini-batch must be the train batch over ``parameter_sync_step`` (trainer_separate_async.py:59)."""
    steps = separate_async_steps(config)
    if steps is None:
        return
    batch, mini = int(config.data.train_batch_size), int(config.actor_rollout_ref.actor.ppo_mini_batch_size)
    if batch != steps * mini:
        raise UsageError(
            f"trainer.v1.separate_async.parameter_sync_step={steps} takes actor_rollout_ref.actor.ppo_mini_batch_size="
            f"{batch // steps} (data.train_batch_size={batch} / {steps}; verl asserts it), not {mini}"
        )


def experimental_config(mode: str) -> tuple[Path, str]:
    """(directory, name) of the hydra config the entry point of experimental ``mode`` composes (verl's own)."""
    import importlib.util

    _, package, name = EXPERIMENTAL_TRAINERS[mode]
    spec = importlib.util.find_spec(package)
    return Path(next(iter(spec.submodule_search_locations))) / "config", name


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")


def _precision(engine_config: str, precision: str) -> list[str]:
    """FSDP mixed-precision settings: ``bf16`` sets none, so verl's default (a GPU run's) applies."""
    return _fp32(engine_config) if precision == "fp32" else []


def _fp32(engine_config: str) -> list[str]:
    """FSDP mixed-precision settings for fp32 everywhere (absent from verl's yaml, hence ``+``)."""
    return [f"+{engine_config}.mixed_precision.{name}=fp32" for name in ("param_dtype", "reduce_dtype", "buffer_dtype")]


def override_key(override: str) -> str:
    """The config key an override sets: ``+a.b=1`` -> ``a.b``."""
    return override.split("=", 1)[0].lstrip("+~")


def merge_overrides(*override_lists: list[str]) -> list[str]:
    """Concatenate override lists; for a key set more than once the last setting wins.

    A ``+key`` (add) keeps its ``+`` when a later plain ``key=`` replaces its value.
    """
    merged: dict[str, str] = {}
    for overrides in override_lists:
        for override in overrides:
            key = override_key(override)
            previous = merged.get(key)
            if previous is not None and previous.startswith("+") and not override.startswith(("+", "~")):
                override = "+" + override
            merged[key] = override
    return list(merged.values())


def compose_config(
    overrides: list[str], config_dir: str | os.PathLike | None = None, config_name: str = "ppo_trainer"
) -> "DictConfig":
    """The trainer config as ``python -m verl.trainer.main_ppo`` composes it: verl's own
    ``ppo_trainer.yaml``, or ``config_name`` in ``config_dir`` (``--config-path``), plus ``overrides``."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    if config_dir is None:
        context = initialize_config_module(config_module="verl.trainer.config", version_base=None)
    else:
        context = initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None)
    with context:
        return compose(config_name=config_name, overrides=list(overrides))

"""The hydra overrides and environment that make verl's own ``ppo_trainer.yaml`` a CPU run.

One list serves the real CLI (``python -m verl.trainer.main_ppo <overrides>``), the in-process
runner and the tests. Every entry is there for a reason given next to it; what verl cannot be
configured into is patched instead (:mod:`verl_ext.cpu.patches`).

The model, prompts and reward come from a task's assets (:class:`RunAssets`; the example task's
are :func:`verl_ext.tasks.arith.assets.build_assets`). From a shell, one override per line
(``recipes/cpu_demo.sh`` reads them with ``mapfile``)::

    python -m verl_ext.apps.overrides --output-dir outputs/cpu --steps 5 --estimator gae
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from verl_ext.cpu import CPU_PROCESS_ENV, ENV_SWITCH, ROLLOUT_NAME
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

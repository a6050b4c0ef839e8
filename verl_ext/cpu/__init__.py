"""CPU backend: run verl 0.9.1's real PPO trainers on a CPU-only machine.

Off unless asked for, by its switch: ``VERL_EXT_CPU=1`` (the verl-ext plugin then calls
:func:`activate` in every verl process; a local Ray cluster inherits the variable, a pre-started one
needs it in ``ray_kwargs.ray_init.runtime_env.env_vars``), or a direct call of :func:`activate`.
Importing this package activates nothing and imports nothing of verl; once active, nothing of verl
is imported until verl itself imports the modules the backend registers into or patches. Every
touch of verl is a record of :data:`verl_ext.touches.CPU_TOUCHES`.

Public entry points (import them from their modules):

* :func:`activate`: install the platform and the patches in this process (the rollout, ``hf_generate``
  (:mod:`verl_ext.hf_rollout`), is the plugin's: it runs without the backend, on a GPU too);
* :func:`verl_ext.cpu.overrides.cpu_overrides` / ``cpu_environment`` / ``merge_overrides``: the
  hydra overrides and environment variables of a CPU run, given a task's assets
  (:class:`verl_ext.cpu.overrides.RunAssets`);
* :mod:`verl_ext.cpu.checkpoint_engine`: the checkpoint engine (``verl_ext_shm``) through which verl's
  asynchronous trainers send the trainer's weights to their rollout on a CPU; ``async_overrides`` in
  :mod:`verl_ext.cpu.overrides`: what else each of them needs there;
* :func:`verl_ext.cpu.in_process.run_in_process`: verl's real ``RayPPOTrainer.fit()`` without Ray,
  with an ``on_batch`` hook (e.g. :class:`verl_ext.cpu.in_process.BatchRecorder`) per step (the
  module needs the backend active before it is imported).

The backend knows no task: the example task lives in :mod:`verl_ext.tasks.arith` and the
applications that train on it (the learning recipe, the demo, the study) in :mod:`verl_ext.apps`.
"""

from __future__ import annotations

import os

from verl_ext.hf_rollout import ROLLOUT_NAME
from verl_ext.options import CPU_SWITCH as ENV_SWITCH
from verl_ext.touches import CPU_VERSIONS

PLATFORM_NAME = "cpu"

#: Set in every process where the backend is active (inherited by a local Ray cluster's workers).
CPU_PROCESS_ENV = {
    "VERL_PLATFORM": PLATFORM_NAME,  # verl's platform_manager picks the registered "cpu" platform
    "HF_HUB_OFFLINE": "1",  # assets are built locally; never reach for a hub
    "TRANSFORMERS_OFFLINE": "1",
    # Ray on a small machine (read by the raylet a run starts): no idle workers started ahead when
    # the driver connects (they lack the job's runtime env, so no actor ever uses them), and no
    # usage-stats reporting (offline; one process fewer). About 10% of a CPU run's CPU time on Ray.
    "RAY_prestart_worker_first_driver": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
}

_active = False


def activate() -> None:
    """Install the CPU backend in this process (idempotent).

    Raises ``RuntimeError`` on a verl other than 0.9.1 and on a host with a usable CUDA GPU
    (a GPU run is meant there; unset ``VERL_EXT_CPU``).
    """
    global _active
    if _active:
        return
    _check_host()
    os.environ[ENV_SWITCH] = "1"  # so Ray workers started from this process activate too
    os.environ.update(CPU_PROCESS_ENV)

    from verl_ext import patching
    from verl_ext.touches import CPU_TOUCHES

    patching.install(CPU_TOUCHES)
    _active = True


def is_active() -> bool:
    """True once :func:`activate` ran in this process."""
    return _active


def _check_host() -> None:
    from importlib.metadata import PackageNotFoundError, version

    from packaging.specifiers import SpecifierSet

    try:
        installed = version("verl")
    except PackageNotFoundError as exc:
        raise RuntimeError(f"verl-ext's CPU backend needs verl{CPU_VERSIONS}, and verl is not installed") from exc
    if not SpecifierSet(CPU_VERSIONS).contains(installed, prereleases=True):
        raise RuntimeError(
            f"verl-ext's CPU backend supports verl{CPU_VERSIONS} only (its patches target that "
            f"code), but verl {installed} is installed. Unset {ENV_SWITCH} or install "
            f"'verl{CPU_VERSIONS}'."
        )
    import torch

    if torch.cuda.is_available():
        raise RuntimeError(
            f"{ENV_SWITCH}=1 on a host with a CUDA GPU: the CPU backend is for CPU-only machines and "
            f"would hide the GPU from verl. Unset {ENV_SWITCH} to train on the GPU."
        )

"""What ``verl-ext doctor`` checks: is the plugin really active in this verl installation?

verl hides a plugin that fails to load, and a touch that cannot apply on a different verl version
would otherwise surface only at the first training step. :func:`diagnose` checks, in order: the
verl version against the supported range, the plugin in this process, every touch of verl listed
in :mod:`verl_ext.touches` (its state here; for the CPU backend's touches when the backend is off,
that their targets exist in this verl), the estimators in verl's registry, the critic rule, whether
a fresh ``import verl`` loads the plugin on its own, whether the modules of verl's PPO path import
(both trainers: verl imports packages there it does not declare, which verl-ext's ``verl-runtime``
extra brings), and the CPU backend's switch.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from verl_ext.errors import one_line
from verl_ext.options import CPU_SWITCH, EXTERNAL_MODULES, cpu_requested


@dataclass
class Finding:
    ok: bool
    topic: str
    detail: str


def diagnose(fresh_import: bool = True):
    from packaging.specifiers import SpecifierSet

    import verl_ext
    from verl_ext import patching
    from verl_ext.integration import plugin
    from verl_ext.touches import SUPPORTED_VERL, TOUCHES

    try:
        import verl
    except ImportError:
        yield Finding(False, "verl", "not importable in this Python environment")
        return

    supported = SpecifierSet(SUPPORTED_VERL).contains(verl.__version__, prereleases=True)
    yield Finding(supported, "verl", f"{verl.__version__} (verl-ext {verl_ext.__version__} supports verl{SUPPORTED_VERL})")
    yield Finding(
        plugin.LOADED and plugin.LOAD_ERROR is None,
        "plugin",
        "loaded in this process" if plugin.LOADED else f"failed to load: {plugin.LOAD_ERROR}",
    )
    states = {state.touch.name: state for state in patching.states()}
    for touch in TOUCHES:
        yield _touch_finding(touch, states.get(touch.name), verl.__version__)
    yield from _registry_findings()
    yield from _critic_findings()
    yield from _ppo_path_findings()
    if fresh_import:
        yield _fresh_import_finding()
    gpus = _gpu_count()
    yield _gpu_finding(gpus)
    cpu = sys.modules.get("verl_ext.cpu")  # never imported here: a GPU run does not load the backend
    active = bool(cpu and cpu.is_active())
    requested = cpu_requested()
    state = "on" if active else ("requested, not active" if requested else "off")
    hint = f": training on this machine needs it, {CPU_SWITCH}=1" if not gpus and not active and not requested else ""
    yield Finding(active or not requested, "cpu backend", f"{state} ({CPU_SWITCH}={os.environ.get(CPU_SWITCH, '')!r}){hint}")


#: The modules ``python -m verl.trainer.main_ppo`` imports on its way to training, per trainer: the legacy
#: trainer's task runner (main_ppo_v0), RayPPOTrainer, its workers, the rollout servers' manager and
#: router, the agent and reward loops; the V1 trainer's main and trainers. Their imports reach every package
#: verl 0.9.1 imports there without declaring it.
PPO_PATH = {
    "legacy trainer": (
        "verl.trainer.main_ppo_v0", "verl.trainer.ppo.ray_trainer", "verl.workers.engine_workers",
        "verl.workers.rollout.llm_server", "verl.experimental.agent_loop", "verl.experimental.reward_loop",
    ),
    "V1 trainer": ("verl.trainer.main_ppo", "verl.trainer.ppo.v1"),
}  # fmt: skip

#: The extra of verl-ext that brings what verl's PPO path imports without declaring it (setup.cfg).
RUNTIME_EXTRA = "verl-runtime"
#: Each import name of that extra's packages -> its distribution (tests/integration/test_doctor.py holds it
#: to setup.cfg's extra and to the installed packages' metadata).
RUNTIME_IMPORTS = {"cachetools": "cachetools", "uvicorn": "uvicorn", "fastapi": "fastapi", "transfer_queue": "TransferQueue"}


def _ppo_path_findings():
    """One finding per trainer: every module of its path imports, or the first that does not and why (a
    missing package named with what installs it)."""
    for trainer, modules in PPO_PATH.items():
        problem = next(filter(None, map(_import_problem, modules)), None)
        yield Finding(problem is None, "ppo path", f"{trainer}: {problem or 'every module imports: ' + ', '.join(modules)}")


def _import_problem(module: str) -> str | None:
    """Why ``module`` does not import here; None when it does."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if not missing or missing == module.split(".")[0]:
            return f"{module} does not import: {one_line(error)}"
        if missing in RUNTIME_IMPORTS:
            return (
                f"{module} imports {missing}, which is not installed: verl needs {RUNTIME_IMPORTS[missing]} without "
                f"declaring it; verl-ext's {RUNTIME_EXTRA} extra brings it: pip install 'verl-ext[{RUNTIME_EXTRA}]'"
            )
        return f"{module} imports {missing}, which is not installed: install the package that provides it"
    except Exception as error:  # noqa: BLE001 - any failure of verl's import is this finding
        return f"{module} does not import: {type(error).__name__}: {one_line(error)}"
    return None


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpu_finding(gpus: int) -> Finding:
    """Informational: verl's trainer needs a GPU unless the CPU backend is on (never a breakage)."""
    if not gpus:
        return Finding(True, "gpu", "none: torch sees no CUDA device, so verl's own trainer cannot run here")
    import torch

    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    return Finding(True, "gpu", f"{gpus} CUDA device(s): {', '.join(names)}")


#: Read by vLLM when first imported: whether it gives its logger a handler of its own.
_VLLM_CONFIGURE_LOGGING = "VLLM_CONFIGURE_LOGGING"


@contextlib.contextmanager
def verl_noise() -> Iterator[list[str]]:
    """Collects, instead of printing, what importing verl says on a machine it was not set up for
    (no accelerator found, optional engines such as megatron not installed, vLLM's "Triton not
    installed"): Python warnings and the log records of verl's and vLLM's loggers. Yields the list of
    their sources (module or logger names), filled when the block ends."""
    sources: list[str] = []
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Collect(logging.WARNING)
    loggers = [logging.getLogger(name) for name in ("verl", "vllm")]
    propagates = [each.propagate for each in loggers]
    # vLLM, when first imported, gives its logger a handler of its own that prints from INFO on (the
    # INFO line "Triton not installed or not compatible" on a machine without a GPU); unconfigured, its
    # records reach the handler here, which keeps warnings and drops the rest
    configure_vllm = os.environ.get(_VLLM_CONFIGURE_LOGGING)
    if "vllm" not in sys.modules:
        os.environ[_VLLM_CONFIGURE_LOGGING] = "0"
    for each in loggers:
        each.addHandler(handler)
        each.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield sources
    finally:
        for each, propagate in zip(loggers, propagates):
            each.removeHandler(handler)
            each.propagate = propagate
        if configure_vllm is None:
            os.environ.pop(_VLLM_CONFIGURE_LOGGING, None)
        else:
            os.environ[_VLLM_CONFIGURE_LOGGING] = configure_vllm
    sources += [record.name for record in records]
    for warning in caught:
        module = _module_of(warning.filename)
        if module.split(".")[0] == "verl_ext":  # verl-ext's own warnings are findings of a kind: shown
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
        else:
            sources.append(module)


def _module_of(filename: str) -> str:
    """``.../site-packages/verl/workers/engine/__init__.py`` -> ``verl.workers.engine``."""
    parts = Path(filename).with_suffix("").parts
    roots = [i for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")]
    top = roots[-1] + 1 if roots else max((i for i, part in enumerate(parts) if part == "verl_ext"), default=len(parts) - 1)
    return ".".join(part for part in parts[top:] if part != "__init__")


def _touch_finding(touch, state, verl_version: str) -> Finding:
    from verl_ext.patching import installed_version

    label, name = touch.kind, f"{touch.component}: {touch.name}"
    written_for = f"{touch.package}{touch.versions}"
    installed = verl_version if touch.package == "verl" else installed_version(touch.package)
    if installed is None:
        return Finding(True, label, f"{name}: n/a, {touch.package} is not installed (written for {written_for})")
    if not touch.covers(installed):
        return Finding(True, label, f"{name}: n/a, written for {written_for} (this is {installed})")
    absent_module, missing = _find_target(touch)  # importing the module is what applies a pending touch
    if state is not None and state.error:
        return Finding(False, label, f"{name}: {state.error}")
    if state is not None and state.applied:
        return Finding(True, label, f"{name} [{written_for}]")
    if absent_module:
        return Finding(True, label, f"{name}: not applied, {absent_module} (written for {written_for})")
    if missing:
        return Finding(False, label, f"{name}: {missing}")
    why = "the CPU backend is off" if state is None else "an override of verl-ext's subclass"
    return Finding(True, label, f"{name}: target present, {why} [{written_for}]")


def _find_target(touch) -> tuple[str | None, str | None]:
    """(why the module is not in this verl, why the target is missing from it), None where fine."""
    from verl_ext.patching import resolve_target

    try:
        module = importlib.import_module(touch.module)
    except Exception as exc:  # noqa: BLE001 - verl's vLLM modules raise ValueError where vLLM is absent or unknown
        return f"{touch.module} cannot be imported here ({one_line(exc)})", None
    try:
        resolve_target(module, touch.target)
    except AttributeError as exc:
        return None, f"target missing in this verl: {exc}"
    return None, None


def _registry_findings():
    from verl.trainer.ppo import core_algos

    from verl_ext import registry
    from verl_ext.integration.patches import REFUSED

    for estimator in registry.all_estimators():
        registered = core_algos.ADV_ESTIMATOR_REGISTRY.get(estimator.name)
        ok = getattr(registered, "__name__", None) == f"verl_ext_{estimator.name}"
        state = "registered" if ok else REFUSED.get(estimator.name, f"registry holds {registered!r}")
        yield Finding(ok, "estimator", f"{estimator.name}: {state} ({estimator.module}) {estimator.formula}")


def _critic_findings():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic

    from verl_ext import registry

    needing = [e.name for e in registry.all_estimators() if e.needs_critic]
    on = [n for n in registry.names() if need_critic(OmegaConf.create({"algorithm": {"adv_estimator": n}, "critic": {"enable": None}}))]
    yield Finding(on == needing, "critic rule", f"critic.enable=null switches the critic on for: {', '.join(on) or 'none'}")


def _fresh_import_finding() -> Finding:
    code = (
        "import sys, verl\n"
        "plugin = sys.modules.get('verl_ext.integration.plugin')\n"
        "print('loaded' if plugin and plugin.LOADED else ('failed: %s' % plugin.LOAD_ERROR if plugin else 'absent'))\n"
    )
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return Finding(False, "fresh import verl", "`python -c 'import verl'` did not finish in 300 s")
    lines = result.stdout.strip().splitlines()
    status = lines[-1] if lines else f"no output (exit {result.returncode}): {result.stderr.strip()[-300:]}"
    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto")
    return Finding(
        status == "loaded",
        "fresh import verl",
        f"plugin {status} (VERL_USE_EXTERNAL_PLUGINS={policy!r}, {EXTERNAL_MODULES}={os.environ.get(EXTERNAL_MODULES, '')!r})",
    )

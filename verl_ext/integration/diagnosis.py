"""What ``verl-ext doctor`` checks: is the plugin really active in this verl installation?

verl hides a plugin that fails to load, and a touch that cannot apply on a different verl version
would otherwise surface only at the first training step. :func:`diagnose` checks, in order: the
verl version against the supported range, the plugin in this process, every touch of verl listed
in :mod:`verl_ext.touches` (its state here; for the CPU backend's touches when the backend is off,
that their targets exist in this verl), the estimators in verl's registry, the critic rule, whether
a fresh ``import verl`` loads the plugin on its own, and the CPU backend's switch.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import dataclass

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
    if fresh_import:
        yield _fresh_import_finding()
    cpu = sys.modules.get("verl_ext.cpu")  # never imported here: a GPU run does not load the backend
    active = bool(cpu and cpu.is_active())
    requested = cpu_requested()
    state = "on" if active else ("requested, not active" if requested else "off")
    yield Finding(active or not requested, "cpu backend", f"{state} ({CPU_SWITCH}={os.environ.get(CPU_SWITCH, '')!r})")


def _touch_finding(touch, state, verl_version: str) -> Finding:
    label, name = touch.kind, f"{touch.component}: {touch.name}"
    if not touch.covers(verl_version):
        return Finding(True, label, f"{name}: n/a, written for verl{touch.versions} (this is {verl_version})")
    absent_module, missing = _find_target(touch)  # importing the module is what applies a pending touch
    if state is not None and state.error:
        return Finding(False, label, f"{name}: {state.error}")
    if state is not None and state.applied:
        return Finding(True, label, f"{name} [{touch.versions}]")
    if absent_module:
        return Finding(True, label, f"{name}: not applied, {absent_module} (written for verl{touch.versions})")
    if missing:
        return Finding(False, label, f"{name}: {missing}")
    why = "the CPU backend is off" if state is None else "an override of verl-ext's subclass"
    return Finding(True, label, f"{name}: target present, {why} [{touch.versions}]")


def _find_target(touch) -> tuple[str | None, str | None]:
    """(why the module is not in this verl, why the target is missing from it), None where fine."""
    from verl_ext.patching import resolve_target

    try:
        module = importlib.import_module(touch.module)
    except ImportError as exc:
        return f"{touch.module} cannot be imported here ({exc})", None
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

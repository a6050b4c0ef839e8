"""``verl-ext doctor``: is the plugin really active in this verl installation?

verl hides a plugin that fails to load, and a patch that cannot apply on a different verl
version would otherwise surface only at the first training step. This command checks, in
order: the verl version against the supported range, the plugin in this process, every patch
of the seam, the estimators in verl's registry, the critic rule, and whether a fresh
``import verl`` loads the plugin on its own.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import dataclass

HELP = "check that verl-ext is loaded, its patches applied and its estimators registered"



@dataclass
class Finding:
    ok: bool
    topic: str
    detail: str


def add_arguments(parser) -> None:
    parser.add_argument("--no-subprocess", action="store_true", help="skip the fresh `import verl` check")


def run(args) -> int:
    findings = list(diagnose(fresh_import=not args.no_subprocess))
    width = max(len(f.topic) for f in findings)
    for finding in findings:
        print(f"{'ok ' if finding.ok else 'BAD'}  {finding.topic:<{width}}  {finding.detail}")
    broken = [f for f in findings if not f.ok]
    print(f"\n{len(findings) - len(broken)} ok, {len(broken)} broken")
    return 1 if broken else 0


def diagnose(fresh_import: bool = True):
    from packaging.version import Version

    import verl_ext
    from verl_ext.integration import plugin, seam

    try:
        import verl
    except ImportError:
        yield Finding(False, "verl", "not importable in this Python environment")
        return

    from verl_ext.integration.patches import SUPPORTED_VERL

    low, high = SUPPORTED_VERL
    supported = Version(low) <= Version(verl.__version__) <= Version(high)
    yield Finding(supported, "verl", f"{verl.__version__} (verl-ext {verl_ext.__version__} supports {low} - {high})")
    yield Finding(
        plugin.LOADED and plugin.LOAD_ERROR is None,
        "plugin",
        "loaded in this process" if plugin.LOADED else f"failed to load: {plugin.LOAD_ERROR}",
    )

    for state in seam.states():
        missing = _import_target(state.patch.module)  # importing is what applies a patch
        if state.applied:
            yield Finding(True, "patch", f"{state.patch.name} [{state.patch.versions}]")
        elif state.error:
            yield Finding(False, "patch", f"{state.patch.name}: {state.error}")
        else:
            yield Finding(True, "patch", f"{state.patch.name}: not applied, {missing} (needed by verl {state.patch.versions})")

    yield from _registry_findings()
    yield from _critic_findings()
    if fresh_import:
        yield _fresh_import_finding()
    from verl_ext import cpu

    state = "on" if cpu.is_active() else ("requested, not active" if cpu.requested() else "off")
    yield Finding(cpu.is_active() or not cpu.requested(), "cpu backend", f"{state} ({cpu.ENV_SWITCH}={os.environ.get(cpu.ENV_SWITCH, '')!r})")


def _import_target(module_name: str) -> str | None:
    """Import a patched module; why it cannot be imported (not in this verl, a missing dependency), or None."""
    try:
        importlib.import_module(module_name)
    except ImportError as exc:
        return f"{module_name} cannot be imported here ({exc})"
    return None


def _registry_findings():
    from verl.trainer.ppo import core_algos

    from verl_ext.integration.estimators import REGISTERED_FUNCTIONS

    for name, function in REGISTERED_FUNCTIONS.items():
        registered = core_algos.ADV_ESTIMATOR_REGISTRY.get(name)
        state = "registered" if registered is function else f"registry holds {registered!r}"
        yield Finding(registered is function, "estimator", f"{name}: {state}")


def _critic_findings():
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic

    from verl_ext.options import ESTIMATOR_NAMES

    on = [n for n in ESTIMATOR_NAMES if need_critic(OmegaConf.create({"algorithm": {"adv_estimator": n}, "critic": {"enable": None}}))]
    yield Finding(on == list(ESTIMATOR_NAMES), "critic rule", f"critic.enable=null switches the critic on for: {', '.join(on) or 'none'}")


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
        f"plugin {status} (VERL_USE_EXTERNAL_PLUGINS={policy!r}, VERL_USE_EXTERNAL_MODULES={os.environ.get('VERL_USE_EXTERNAL_MODULES', '')!r})",
    )

"""What verl loads: the entry point of group ``verl.plugins`` (verl >= 0.9, on every
``import verl``), ``VERL_USE_EXTERNAL_MODULES=verl_ext`` (verl >= 0.6), or a plain
``import verl_ext``.

Loading installs the seam's post-import hooks and nothing else: no verl module is imported
here, so ``import verl`` stays as fast as without the plugin (benchmarks/bench_import.py).
With ``VERL_EXT_CPU=1`` it also activates the CPU backend (:mod:`verl_ext.cpu`).

verl swallows exceptions raised by an entry point (logged at DEBUG level), so a failure here is
reported on stderr and kept in :data:`LOAD_ERROR` for ``verl-ext doctor``.
"""

from __future__ import annotations

import logging
import sys

LOADED = False
LOAD_ERROR: str | None = None


def activate() -> None:
    global LOADED
    from verl_ext.integration import seam
    from verl_ext.integration.patches import PLUGIN_HOOKS, PLUGIN_PATCHES

    seam.install(PLUGIN_PATCHES)
    for module_name, hook in PLUGIN_HOOKS:
        seam.when_imported(module_name, hook)
    from verl_ext import cpu

    if cpu.requested():
        cpu.activate()
    LOADED = True


if not LOADED:
    try:
        activate()
    except Exception as exc:  # loud, because verl would hide it
        LOAD_ERROR = f"{type(exc).__name__}: {exc}"
        logging.getLogger("verl_ext").exception("verl-ext plugin failed to load")
        print(f"verl-ext: plugin failed to load ({LOAD_ERROR}); run `verl-ext doctor`", file=sys.stderr)

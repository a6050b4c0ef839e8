"""Activating the verl-ext plugin in a verl process; importing this module does nothing by itself.

verl activates the plugin in every process that imports verl (the driver, the Ray TaskRunner, the
workers), in one of two ways:

* verl >= 0.9 loads the entry point ``verl_ext = verl_ext.integration.plugin:activated`` of group
  ``verl.plugins`` on every ``import verl``. Looking up ``activated`` (this module's ``__getattr__``)
  is what activates;
* ``VERL_USE_EXTERNAL_MODULES=verl_ext`` (verl >= 0.6) makes verl import the package ``verl_ext``,
  which activates when that variable names it.

Activation installs the plugin's touches of verl (:data:`verl_ext.touches.PLUGIN_TOUCHES`), applied
lazily as verl's modules are imported, so ``import verl`` stays as fast as without the plugin
(benchmarks/bench_import.py). With ``VERL_EXT_CPU=1`` it also activates the CPU backend.

verl swallows exceptions raised by an entry point (logged at DEBUG level), so a failure here is
reported on stderr and kept in :data:`LOAD_ERROR` for ``verl-ext doctor``.
"""

from __future__ import annotations

import logging
import sys

from verl_ext.options import cpu_requested

LOADED = False
LOAD_ERROR: str | None = None
#: How the plugin was activated in this process: "entry point", "VERL_USE_EXTERNAL_MODULES" or "call".
ACTIVATED_BY: str | None = None



def activate(by: str = "call") -> None:
    """Install the plugin's touches of verl in this process (idempotent); raises on failure."""
    global LOADED, ACTIVATED_BY
    from verl_ext import patching
    from verl_ext.touches import PLUGIN_TOUCHES

    patching.install(PLUGIN_TOUCHES)
    if cpu_requested():  # read here, from options, so that a GPU run never imports the backend
        from verl_ext import cpu

        cpu.activate()
    ACTIVATED_BY = ACTIVATED_BY or by
    LOADED = True


def activate_loudly(by: str) -> bool:
    """:func:`activate`, reporting a failure on stderr instead of raising (verl would hide it)."""
    global LOAD_ERROR
    if LOADED:
        return True
    try:
        activate(by)
    except Exception as exc:  # loud, because verl would hide it
        LOAD_ERROR = f"{type(exc).__name__}: {exc}"
        logging.getLogger("verl_ext").exception("verl-ext plugin failed to load")
        print(f"verl-ext: plugin failed to load ({LOAD_ERROR}); run `verl-ext doctor`", file=sys.stderr)
    return LOADED


def __getattr__(name: str):
    if name == "activated":  # what verl's entry-point loader looks up
        return activate_loudly("entry point")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""verl-ext: value-based advantage estimators, a per-token trace and its inspection for verl.

Importing ``verl_ext`` or any of its modules activates nothing. verl activates the plugin itself:
through its entry point, or through ``VERL_USE_EXTERNAL_MODULES=verl_ext``, which names this package
(see :mod:`verl_ext.integration.plugin`).

``verl_ext.register_estimator`` adds an advantage estimator (see :mod:`verl_ext.registry`).
"""

from __future__ import annotations

__version__ = "0.2.0"

__all__ = ["__version__", "register_estimator"]


def __getattr__(name: str):
    if name == "register_estimator":  # imported on use: the registry loads torch
        from verl_ext.registry import register_estimator

        return register_estimator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


from verl_ext.options import EXTERNAL_MODULES as _EXTERNAL_MODULES  # noqa: E402 - after the public names
from verl_ext.options import external_modules as _external_modules  # noqa: E402

if "verl_ext" in _external_modules():
    from verl_ext.integration.plugin import activate_loudly

    activate_loudly(_EXTERNAL_MODULES)

"""verl-ext: value-based advantage estimators, a per-token trace and its inspection for verl.

Importing this package activates the verl plugin (lazy post-import hooks, nothing heavy is
imported): the same thing verl's entry point ``verl.plugins`` and
``VERL_USE_EXTERNAL_MODULES=verl_ext`` do. See :mod:`verl_ext.integration.plugin`.
"""

__version__ = "0.1.0"

from verl_ext.integration import plugin as _plugin  # noqa: E402,F401  (activation on import)

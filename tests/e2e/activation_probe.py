"""Test-only module for multi-node runs (loaded with VERL_USE_EXTERNAL_MODULES in every process): once
verl's core_algos is imported, record how verl-ext was activated in this process.

verl imports the external modules before it loads entry points, so this module waits for a later
import to look. One JSON line per process in $VERL_EXT_TEST_PROBE_DIR/<pid>.json.

Covers no module by itself: tests/e2e/test_multinode.py reads what it records of verl_ext's
activation (verl_ext.integration.plugin) through verl_ext.patching.
"""

from __future__ import annotations

import json
import os
import socket

from verl_ext.patching import when_imported


def _record(core_algos) -> None:
    import sys

    plugin = sys.modules.get("verl_ext.integration.plugin")
    try:
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001
        node = None
    report = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "node": node,
        "loaded": bool(plugin and plugin.LOADED),
        "activated_by": plugin.ACTIVATED_BY if plugin else None,
    }
    with open(os.path.join(os.environ["VERL_EXT_TEST_PROBE_DIR"], f"{os.getpid()}.json"), "w") as file:
        json.dump(report, file)


if os.environ.get("VERL_EXT_TEST_PROBE_DIR"):
    when_imported("verl.trainer.ppo.core_algos", _record)

"""Example tasks for the CPU backend, each built locally (no download): :mod:`.arith` (the default)
and :mod:`.tool` (the same question, with a calculator the policy may call through verl's tool
agent loop)."""

from __future__ import annotations

import importlib

#: task name -> the module whose ``build_assets()`` builds its assets.
TASK_ASSETS = {"arith": "verl_ext.tasks.arith.assets", "tool": "verl_ext.tasks.tool.assets"}


def build_task_assets(task: str, cache_dir=None):
    """The built assets of ``task`` (:data:`TASK_ASSETS`) in ``cache_dir`` (default: the shared cache),
    from the cache when they exist."""
    if task not in TASK_ASSETS:
        from verl_ext.errors import UsageError

        raise UsageError(f"unknown task {task!r}; the tasks are: {', '.join(TASK_ASSETS)}")
    return importlib.import_module(TASK_ASSETS[task]).build_assets(cache_dir)

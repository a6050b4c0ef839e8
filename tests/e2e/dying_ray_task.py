"""Test-only Ray task for tests/e2e/test_check_on_ray.py: verl_ext.trace.parallel's own task, except
that a step whose marker file exists (``kill-step-<n>`` beside the trace) kills the Ray worker that runs
it, as the out-of-memory killer would, after a line in ``kills`` beside it (one line per try). A module of its own, so that a Ray worker imports only this to
run it.

Covers no module by itself: it feeds the test of verl_ext.trace.parallel's Ray path."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from verl_ext.trace import parallel

_in_ray_task = parallel._in_ray_task


def in_ray_task(fn, path: str, step: int):
    beside = Path(path).parent
    if (beside / f"kill-step-{step}").exists():
        with open(beside / "kills", "a") as kills:
            kills.write(f"{step}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    return _in_ray_task(fn, path, step)

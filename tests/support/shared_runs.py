"""Trainer runs made once per test session and read by every test that needs the same run.

A verl run is the suite's costliest thing (an interpreter that imports verl, builds its workers and
trains). Tests that need a run with the same settings share one: :func:`shared_run` makes it in a
directory named after its key, under the session's temporary root that all pytest-xdist workers of
one session share, and under a lock, so that two workers never make one run twice (the second waits
for the first, as :func:`verl_ext.tasks.common.cached_build` does for the assets). A run that failed
fails every test that asks for it with the same output, without being tried again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
from pathlib import Path
from typing import Callable

import pytest

DONE, FAILED = "shared_run.done", "shared_run.failed"


def session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary directory of this test session that every xdist worker of it shares."""
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's base is <session>/popen-gwN; without xdist the base is the session's own.
    root = base.parent if base.name.startswith("popen-gw") else base
    (root / "shared_runs").mkdir(exist_ok=True)
    return root / "shared_runs"


def shared_run(tmp_path_factory: pytest.TempPathFactory, key: object, make: Callable[[Path], None]) -> Path:
    """The directory of the run ``key`` names (any JSON-able description of its settings), made by
    ``make(directory)`` the first time any worker of the session asks for it."""
    text = json.dumps(key, sort_keys=True, default=str)
    name = hashlib.sha256(text.encode()).hexdigest()[:12]
    root = session_root(tmp_path_factory)
    out = root / name
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second worker waits for the run in progress
        if not (out / DONE).exists() and not (out / FAILED).exists():
            out.mkdir(exist_ok=True)
            (out / "shared_run.key.json").write_text(text)
            try:
                make(out)
            except BaseException as error:  # pytest.fail raises a BaseException
                (out / FAILED).write_text(f"{type(error).__name__}: {error}")
                raise
            (out / DONE).touch()
    if (out / FAILED).exists():
        pytest.fail(f"the shared run {out} failed (made by another test):\n{(out / FAILED).read_text()[-6000:]}")
    return out

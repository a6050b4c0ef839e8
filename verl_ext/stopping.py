"""Stopping a run between two steps, when the command that started it is asked to (Ctrl-C, SIGTERM).

A trainer killed mid-step leaves the step half-recorded and, on Ray, the cluster's processes behind.
verl-ext's commands (``verl-ext demo``, ``selftest``, ``study``, ``recipes/cpu_demo.sh``) stop a run
another way: on the first signal they create the run's stop file, named by :data:`STOP_FILE_ENV` in
every process of the run (verl_ext.cpu.overrides.cpu_environment; a file, because the trainer may be a
Ray actor, which no terminal signal reaches). Each step looks for it at its start
(:func:`raise_if_requested`, before the step records anything) and raises :class:`StopRequested`:
the fit wrappers close the trace as on any error, so every step that finished is written whole and
the run record says the run did not finish; verl's driver then ends as after any error, shutting
down the cluster it started. The command says in one line where the run stopped
(:mod:`verl_ext.apps.progress`).
"""

from __future__ import annotations

import os

from verl_ext.options import STOP_FILE, STOP_FILE_ENV

__all__ = ["INTERRUPTED", "STOP_FILE", "STOP_FILE_ENV", "StopRequested", "raise_if_requested", "requested"]

#: The exit status of a command whose run was stopped (a shell's 128 + SIGINT).
INTERRUPTED = 130


class StopRequested(Exception):
    """The run was asked to stop; raised at the start of the next step."""


def requested() -> bool:
    """True once this run's stop file exists."""
    path = os.environ.get(STOP_FILE_ENV)
    return bool(path) and os.path.exists(path)


def raise_if_requested(step: int) -> None:
    """:class:`StopRequested` when the run was asked to stop, before step ``step`` records anything."""
    if requested():
        raise StopRequested(f"stopped before step {step}: asked to stop ({os.environ[STOP_FILE_ENV]} exists)")

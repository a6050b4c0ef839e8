"""verl's loggers (``verl.utils.tracking.Tracking``: wandb, tensorboard, mlflow, its file logger, …)
finished when the ``fit()`` that made them ends, with its outcome.

verl 0.9.1 never finishes the legacy trainer's logger: ``RayPPOTrainer.fit`` keeps its ``Tracking`` in a
local and leaves it to ``Tracking.__del__``. That local outlives ``fit()``: verl's ``fit`` calls
``config.get(key, default)`` on keys its struct config lacks, and omegaconf answers them by raising and
catching an exception whose traceback holds its own frame, a reference cycle that reaches ``fit``'s
frame (and its ``logger``) through ``f_back``; only the cyclic garbage collector frees it, and on a Ray
TaskRunner, idle after ``fit()``, that was at interpreter exit, after W&B's service had gone. The W&B
run then held none of the steps its service had not yet written (a 2-step CPU run: nothing after the
validation before training, a 32 KB ``.wandb`` file, "running" for ever) and a ``ConnectionResetError``
traceback followed. verl's V1 task runner finishes its trainer's logger itself (``TaskRunnerV1.run``);
a V1 trainer driven otherwise does not.

So every ``Tracking`` made while a ``fit()`` of verl's trainers runs (both trainers, through their fit
wrappers, :mod:`verl_ext.integration.patches`) is finished when that ``fit()`` returns (exit code 0)
or raises (exit code 1: W&B marks the run failed), before anything else of the process ends. Finishing
twice is a no-op in verl (``Tracking.finish`` marks itself done), so a task runner that finishes it too,
and its ``__del__`` later, do nothing more. Once verl's W&B runs are finished and no other is active,
W&B's service is torn down too (``wandb.teardown``), while it is still there: W&B's own exit hook would
try it at the process' exit and, on Ray, print a ``ConnectionResetError`` traceback.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import Any, Callable, Iterator

from verl_ext.errors import one_line

logger = logging.getLogger("verl_ext")

#: The loggers made during the ``fit()`` running now (None outside any).
_made: list[Any] | None = None


@contextlib.contextmanager
def finished_when_fit_ends() -> Iterator[list[Any]]:
    """Around one ``fit()``: yields the list of the ``Tracking`` objects made inside it, and finishes each
    at the end, with exit code 0 when the block returned and 1 when it raised (the error propagates;
    a logger that fails to finish is one warning line, never an error that hides the run's)."""
    global _made
    outer, made = _made, []
    _made = made
    failed = True
    try:
        yield made
        failed = False
    finally:
        _made = outer
        for tracking in made:
            try:
                tracking.finish(exit_code=1 if failed else 0)
            except Exception as error:  # noqa: BLE001 - a logger's failure must not hide fit()'s outcome
                logger.warning("verl-ext: verl's logger (trainer.logger) did not finish: %s", one_line(error))
        _release_wandb(made)


def _release_wandb(made: list[Any]) -> None:
    """W&B's service torn down once the runs verl's loggers made are finished, if no W&B run is left active
    (a user's own run keeps it)."""
    wandb = sys.modules.get("wandb")
    if wandb is None or not any(getattr(tracking, "logger", {}).get("wandb") is wandb for tracking in made):
        return
    if getattr(wandb, "run", None) is not None:
        return
    try:
        wandb.teardown()
    except (Exception, SystemExit) as error:  # noqa: BLE001 - W&B's exit code for its service: a warning, not fit()'s outcome
        logger.warning("verl-ext: W&B's service did not shut down cleanly: %s", one_line(error) if str(error) else type(error).__name__)


def wrap_tracking_init(original: Callable) -> Callable:
    """``Tracking.__init__``: a logger made during a ``fit()`` is remembered, to be finished when it ends."""

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if _made is not None:
            _made.append(self)

    return __init__

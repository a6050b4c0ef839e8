"""Where verl's trainers meet the non-finite check (:mod:`verl_ext.nonfinite`), trace or no trace.

The patches in :mod:`verl_ext.integration.patches` call in here:

* ``session(trainer)`` around ``fit()`` (legacy and V1 trainer): the step comes from
  ``trainer.global_steps`` and the mode from the run's ``verl_ext.nonfinite`` (warn, raise, off);
  outside ``fit()`` (a direct call of ``compute_advantage``) the mode is warn and the step is
  ``meta_info["global_steps"]`` when the batch has it.
* ``after_advantage(data)`` at the end of ``compute_advantage``, which both trainers call before
  their updates, after the trace has captured the step: rewards, values, returns, advantages and
  the log-probs of the batch are checked on its valid tokens. warn prints the finding's line on
  stderr (through tqdm, so that it is not glued to verl's progress bar) and training goes on; raise raises :class:`~verl_ext.nonfinite.NonFiniteError` with it.
* ``deferred()`` around the V1 trainer's ``_compute_advantage``, where the trace captures the step
  only after ``compute_advantage`` returned: a raise is held until the end of the block, so that
  the traced step is on disk when the run stops (still before the update).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

from verl_ext import nonfinite
from verl_ext.options import NONFINITE_DEFAULT, nonfinite_mode
from verl_ext.trace.schema import FLOAT_COLUMNS

#: The per-token quantities of verl's batch the check reads: the trace schema's, by their batch keys.
QUANTITIES = tuple(column.verl_key for column in FLOAT_COLUMNS if column.verl_key)

_trainer: Any = None
_mode: str | None = None
_held: list[nonfinite.NonFiniteError] | None = None


@contextlib.contextmanager
def session(trainer: Any) -> Iterator[None]:
    """The run's mode and step source for the duration of ``fit()``."""
    global _trainer, _mode
    outer = _trainer, _mode
    _trainer, _mode = trainer, nonfinite_mode(trainer.config)
    try:
        yield
    finally:
        _trainer, _mode = outer


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Hold a raise of :func:`after_advantage` until the block ends without another error."""
    global _held
    outer, _held = _held, []
    try:
        yield
        held = _held
    finally:
        _held = outer
    if held:
        raise held[0]


def after_advantage(data: Any) -> nonfinite.Finding | None:
    """Check a batch whose advantages and returns verl has just computed (module docstring)."""
    mode = _mode or NONFINITE_DEFAULT
    if mode == "off":
        return None
    batch = data.batch
    keys = set(batch.keys())
    finding = nonfinite.find({name: batch[name] for name in QUANTITIES if name in keys}, batch["response_mask"])
    if finding is None:
        return None
    line = finding.line(step=_step(data), uid=data.non_tensor_batch.get("uid"))
    if mode == "raise":
        error = nonfinite.NonFiniteError(line)
        if _held is None:
            raise error
        _held.append(error)
    else:
        _say(line)
    return finding


def _say(line: str) -> None:
    """The line on stderr, on a line of its own also under verl's tqdm progress bar."""
    try:
        from tqdm import tqdm
    except ImportError:  # verl depends on tqdm; without it, plain print
        print(line, file=sys.stderr, flush=True)
        return
    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


def _step(data: Any) -> int | None:
    if _trainer is not None and getattr(_trainer, "global_steps", None) is not None:
        return int(_trainer.global_steps)
    step = getattr(data, "meta_info", {}).get("global_steps")
    return None if step is None else int(step)

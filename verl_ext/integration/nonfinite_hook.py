"""The non-finite check (:mod:`verl_ext.nonfinite`) on verl's batch, trace or no trace.

:func:`verl_ext.integration.step.advantage` calls :func:`check` at the end of
every advantage step: rewards, values, returns, advantages and the log-probs of the batch are checked
on its valid tokens. warn prints the finding's line on stderr
(through tqdm, so that it is not glued to verl's progress bar) and training goes on; raise hands back
a :class:`~verl_ext.nonfinite.NonFiniteError` with it, which the step raises (the V1 trainer's once
verl has stored the step and the trace has it).
"""

from __future__ import annotations

import sys
from typing import Any

from verl_ext import nonfinite
from verl_ext.trace.schema import FLOAT_COLUMNS

#: The per-token quantities of verl's batch the check reads: the trace schema's, by their batch keys.
QUANTITIES = tuple(column.verl_key for column in FLOAT_COLUMNS if column.verl_key)


def check(data: Any, mode: str, step: int | None) -> nonfinite.NonFiniteError | None:
    """Check a batch whose advantages and returns verl has just computed; with ``mode`` raise, the
    error to raise (None when everything is finite, or with warn, which says it here, or off)."""
    if mode == "off":
        return None
    batch = data.batch
    keys = set(batch.keys())
    finding = nonfinite.find({name: batch[name] for name in QUANTITIES if name in keys}, batch["response_mask"])
    if finding is None:
        return None
    line = finding.line(step=step, uid=data.non_tensor_batch.get("uid"))
    if mode == "raise":
        return nonfinite.NonFiniteError(line)
    _say(line)
    return None


def _say(line: str) -> None:
    """The line on stderr, on a line of its own also under verl's tqdm progress bar."""
    try:
        from tqdm import tqdm
    except ImportError:  # verl depends on tqdm; without it, plain print
        print(line, file=sys.stderr, flush=True)
        return
    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()

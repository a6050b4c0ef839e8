"""The responses of a traced step that were cut at the length limit, and V(s_L) where the run kept it
(docs/definitions.md#truncated-responses).

The prompt table says which responses were cut (``truncated``), for a run that bootstrapped the
critic's value after each cut response's last token (``bootstrap_value``, null elsewhere), and, where
the rollout engine said it (verl's vLLM rollout), why the engine ended each response (``stop_reason``).
:class:`StepCuts` aligns both with a step's :class:`~verl_ext.steps.layout.StepLayout`; what each treatment
of ``algorithm.truncation`` makes of them is :mod:`verl_ext.steps.as_run`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verl_ext.steps.layout import StepLayout, floats

#: The prompt table's columns read here.
CUT_COLUMN = "truncated"
BOOTSTRAP_COLUMN = "bootstrap_value"
STOP_COLUMN = "stop_reason"
#: The engine's stop reason of a response it ended at the length limit (vLLM's finish_reason).
STOPPED_AT_LENGTH = "length"
#: Where every message about the cut points.
SECTION = "docs/definitions.md#truncated-responses"


@dataclass(frozen=True)
class StepCuts:
    """Per sample of a step's layout (0 … B−1): ``cut`` (bool; None when the trace records no flags),
    ``bootstrap_value`` (float64, NaN where null; None when no sample has one) and the rollout engine's
    ``stop_reason`` (object: str or None; None when no sample has one)."""

    cut: np.ndarray | None
    bootstrap_value: np.ndarray | None
    stop_reason: np.ndarray | None = None

    @classmethod
    def read(cls, trace, step: int, layout: StepLayout) -> "StepCuts":
        return cls.of(trace.prompts(step), layout)

    @classmethod
    def of(cls, prompts, layout: StepLayout) -> "StepCuts":
        """From a step's prompt table (a sample it lacks counts as not cut, without V(s_L))."""
        at = layout.index_of(prompts.column("sample").to_numpy())
        known = at >= 0
        cut = None
        flags = prompts.column(CUT_COLUMN)
        if len(flags) and flags.null_count < len(flags):
            cut = np.zeros(layout.samples, bool)
            cut[at[known]] = flags.fill_null(False).to_numpy(zero_copy_only=False)[known]
        bootstrap = None
        if BOOTSTRAP_COLUMN in prompts.column_names:
            column = prompts.column(BOOTSTRAP_COLUMN)
            if len(column) and column.null_count < len(column):
                bootstrap = np.full(layout.samples, np.nan)
                bootstrap[at[known]] = floats(column)[known]
        reasons = None
        if STOP_COLUMN in prompts.column_names:
            column = prompts.column(STOP_COLUMN)
            if len(column) and column.null_count < len(column):
                reasons = np.full(layout.samples, None, object)
                reasons[at[known]] = np.asarray(column.to_pylist(), object)[known]
        return cls(cut, bootstrap, reasons)

    @property
    def recorded(self) -> bool:
        return self.cut is not None

    def at_tokens(self, layout: StepLayout) -> np.ndarray:
        """(N,) bool at the step's valid tokens: the token belongs to a cut response."""
        return self.cut[layout.valid_sample_index()]

    def why_not(self, mode: str) -> str | None:
        """Why ``mode`` cannot be recomputed on this step (one line), None when it can."""
        if mode == "terminal":
            return None
        if self.cut is None:
            return f"the trace records no truncated flags, so no response is known to be cut ({SECTION})"
        if mode == "bootstrap" and self.cut.any():
            values = np.full(len(self.cut), np.nan) if self.bootstrap_value is None else self.bootstrap_value
            if not np.isfinite(values[self.cut]).all():
                return (
                    f"the trace holds no V(s_L) (bootstrap_value) for its cut responses: only a run with "
                    f"algorithm.truncation=bootstrap keeps the critic's value after the last token ({SECTION})"
                )
        return None

    def truncation(self, mode: str, samples: np.ndarray):
        """The :class:`~verl_ext.truncation.Truncation` of the samples at ``samples`` (layout indices)."""
        import torch

        from verl_ext.truncation import Truncation

        cut = torch.from_numpy(np.zeros(len(samples), bool) if self.cut is None else self.cut[samples])
        bootstrap = None
        if mode == "bootstrap":
            values = np.zeros(len(samples)) if self.bootstrap_value is None else self.bootstrap_value[samples]
            bootstrap = torch.from_numpy(np.where(np.isfinite(values), values, 0.0))
        return Truncation(mode, cut, bootstrap)


def last_step_with_cuts(trace) -> int | None:
    """The last step of ``trace`` with a response cut at the length limit (its prompt table's
    ``truncated``), None when no step has one or the trace records no flags. A step whose prompt table
    does not read is passed over (a command that reads it says so)."""
    from verl_ext.errors import StepFileError

    for step in reversed(trace.steps):
        try:
            flags = trace.prompts(step).column(CUT_COLUMN)
        except StepFileError:
            continue
        if flags.fill_null(False).to_numpy(zero_copy_only=False).any():
            return step
    return None

"""What a check identity finds, and the one comparison and the tolerances every identity uses.

A check (:data:`verl_ext.check.identities.IDENTITIES`) returns a :class:`Finding`: what it found on
one step, usually through :func:`compare`. The check names it with the identity and the step
(:class:`StepResult`) and aggregates the steps (:class:`IdentityResult`).

Tolerances are ``ATOL`` + a multiple of float32's ε × the magnitude of the numbers the producer
combined (docs/definitions.md#tolerances); a :class:`Tolerance` keeps the bound and the text the
report prints for it together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = ["ATOL", "EPS32", "Finding", "IdentityResult", "Location", "StepResult", "Tolerance", "Violation"]

#: The note of a finding that was not evaluated although its identity applies to the run; its reason follows.
NOT_CHECKED = "not checked: "

EPS32 = float(np.finfo(np.float32).eps)  # 2^-23
#: Below this nothing is claimed: float32 data of order one round at ~6e-8.
ATOL = 1e-6
#: Machine epsilon per dtype name as the trace records one (the run record's ``update.<kind>.dtype``,
#: a step's ``stored_dtypes``); float32's where none is recorded.
DTYPE_EPS = {"fp32": EPS32, "bf16": 2.0**-7, "fp16": 2.0**-10}


@dataclass(frozen=True)
class Tolerance:
    """How far a number may be from its due value: the bound (a function of the magnitudes it
    scales with) and how the report writes it."""

    text: str
    bound: Callable[..., Any] = lambda: 0.0

    def __call__(self, *magnitudes):
        return self.bound(*magnitudes)


EXACT = Tolerance("exact")
#: An identity between operands whose magnitudes add up to ``scale``: one or two roundings, ``eps``
#: their dtype's (float32's unless a bf16 run's loss computed it, verl_ext.check.update_checks).
ELEMENTWISE = Tolerance(f"{ATOL:g} + 4ε·Σ|operand|", lambda scale, eps=EPS32: ATOL + 4 * eps * scale)


# --------------------------------------------------------------------------- results as data


@dataclass(frozen=True)
class Location:
    step: int
    sample: int | None = None
    token_index: int | None = None

    def __str__(self) -> str:
        parts = [f"step {self.step}"]
        if self.sample is not None:
            parts.append(f"sample {self.sample}")
        if self.token_index is not None:
            parts.append(f"token {self.token_index}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Violation:
    """The first offending token of an identity: what the trace holds and what was due."""

    location: Location
    column: str
    actual: float | None = None
    expected: float | None = None
    error: float | None = None
    tolerance: float | None = None
    detail: str | None = None

    def __str__(self) -> str:
        text = f"{self.location}: {self.column}"
        if self.expected is not None:
            text += f" = {self.actual:.7g}, expected {self.expected:.7g}"
            if self.error is not None and self.tolerance is not None:  # an exact identity has neither
                text += f" (|Δ| {self.error:.2e} > tolerance {self.tolerance:.2e})"
        elif self.actual is not None:
            text += f" = {self.actual:.7g}"
        return text + (f": {self.detail}" if self.detail else "")


@dataclass(frozen=True)
class Finding:
    """What one identity found on one step."""

    #: "pass", "fail", "skipped" (the identity does not apply to this run or trace) or "unchecked"
    #: (it applies, but could not be evaluated in this process: the note says why)
    status: str
    checked: int = 0
    violations: int = 0
    max_abs_error: float | None = None
    first: Violation | None = None
    note: str | None = None


@dataclass(frozen=True, kw_only=True)
class StepResult(Finding):
    """One identity on one step: its finding, named."""

    identity: str
    step: int


@dataclass(frozen=True)
class IdentityResult:
    """One identity over all checked steps."""

    identity: str
    title: str
    tolerance: str
    #: "fail" if any step fails, else "unchecked" if any step could not be evaluated, else "pass" if
    #: any step passed, else "skipped"
    status: str
    checked: int
    violations: int
    max_abs_error: float | None
    first: Violation | None
    notes: tuple[str, ...]


def skipped(why: str) -> Finding:
    return Finding("skipped", note=f"not applicable: {why}")


def unchecked(why: str) -> Finding:
    """An identity that applies to the run but cannot be evaluated here; ``why`` names the fix."""
    return Finding("unchecked", note=NOT_CHECKED + why)


def compare(actual, expected, tolerance, where: Callable[[int], tuple[Location, str]], note: str | None = None) -> Finding:
    """``actual`` against ``expected`` within ``tolerance`` (NaN is a violation); ``where(i)`` names
    the i-th number: (its location, its column) for the first violation."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    error = np.abs(actual - expected)
    bad = ~(error <= tolerance)
    violations = int(np.count_nonzero(bad))
    first = None
    if violations:
        i = int(np.argmax(bad))
        location, column = where(i)
        if np.isfinite(actual[i]) and np.isfinite(expected[i]):
            bound = float(np.broadcast_to(tolerance, error.shape)[i])
            first = Violation(location, column, float(actual[i]), float(expected[i]), float(error[i]), bound)
        else:
            first = Violation(location, column, float(actual[i]), detail=f"not finite (expected {expected[i]:.7g})")
    return Finding(
        "fail" if violations else "pass", checked=len(error), violations=violations,
        max_abs_error=float(np.max(error)) if len(error) else None, first=first, note=note,
    )  # fmt: skip


def combine(findings: list[Finding], note: str | None = None) -> Finding:
    """Several comparisons of one identity as one finding: failed if any failed, its first violation."""
    failed = [f for f in findings if f.status == "fail"]
    return Finding(
        "fail" if failed else "pass", checked=sum(f.checked for f in findings),
        violations=sum(f.violations for f in findings), max_abs_error=_largest(f.max_abs_error for f in findings),
        first=failed[0].first if failed else None, note=note,
    )  # fmt: skip


def aggregate(identity: str, title: str, tolerance: str, results: list[StepResult]) -> IdentityResult:
    """One identity over all its steps: failed if any step failed, else not checked if any step was
    not, else passed if any passed, else skipped."""
    statuses = {r.status for r in results}
    status = next((s for s in ("fail", "unchecked", "pass") if s in statuses), "skipped")
    steps_by_note: dict[str, list[int]] = {}
    for r in results:
        if r.note:
            steps_by_note.setdefault(r.note, []).append(r.step)
    notes = tuple(f"{_steps_text(s, len(results))}: {note}" for note, s in steps_by_note.items())
    return IdentityResult(
        identity=identity,
        title=title,
        tolerance=tolerance,
        status=status,
        checked=sum(r.checked for r in results),
        violations=sum(r.violations for r in results),
        max_abs_error=_largest(r.max_abs_error for r in results),
        first=next((r.first for r in results if r.first is not None), None),
        notes=notes,
    )


def _largest(errors) -> float | None:
    """The largest error, NaN the largest of all (a NaN error is a NaN in the data)."""
    errors = [e for e in errors if e is not None]
    return max(errors, key=lambda e: math.inf if math.isnan(e) else e) if errors else None


def _steps_text(steps: list[int], total: int) -> str:
    if len(steps) == total and total > 1:
        return "all steps"
    shown = ", ".join(str(s) for s in steps[:8]) + (", …" if len(steps) > 8 else "")
    return ("step " if len(steps) == 1 else "steps ") + shown

"""The result of checking a trace, as data: per identity and step, and per identity overall."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from verl_ext.inspect.recorded import RecordedAlgorithm


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
            text += f" (|Δ| {self.error:.2e} > tolerance {self.tolerance:.2e})"
        elif self.actual is not None:
            text += f" = {self.actual:.7g}"
        return text + (f": {self.detail}" if self.detail else "")


@dataclass(frozen=True)
class StepResult:
    """One identity on one step."""

    identity: str
    step: int
    status: str  # "pass", "fail" or "skipped"
    checked: int = 0
    violations: int = 0
    max_abs_error: float | None = None
    first: Violation | None = None
    note: str | None = None


@dataclass(frozen=True)
class IdentityResult:
    """One identity over all checked steps."""

    identity: str
    title: str
    tolerance: str
    status: str  # "fail" if any step fails, else "pass" if any step passed, else "skipped"
    checked: int
    violations: int
    max_abs_error: float | None
    first: Violation | None
    notes: tuple[str, ...]


@dataclass(frozen=True)
class CheckReport:
    path: str
    algorithm: RecordedAlgorithm
    steps: tuple[int, ...]
    tokens: int
    identities: tuple[IdentityResult, ...]
    per_step: tuple[StepResult, ...]

    @property
    def passed(self) -> bool:
        return all(result.status != "fail" for result in self.identities)

    def __getitem__(self, identity: str) -> IdentityResult:
        for result in self.identities:
            if result.identity == identity:
                return result
        raise KeyError(f"no identity {identity!r}; the report has {[r.identity for r in self.identities]}")

    def to_arrow(self) -> pa.Table:
        """One row per (identity, step): status, counts, max abs error, first violation."""
        rows = [
            {
                "identity": r.identity,
                "step": r.step,
                "status": r.status,
                "checked": r.checked,
                "violations": r.violations,
                "max_abs_error": r.max_abs_error,
                "first_sample": r.first.location.sample if r.first else None,
                "first_token_index": r.first.location.token_index if r.first else None,
                "first_violation": str(r.first) if r.first else None,
                "note": r.note,
            }
            for r in self.per_step
        ]
        return pa.Table.from_pylist(rows, schema=_PER_STEP_SCHEMA)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (per identity)."""
        return {
            "path": self.path,
            "estimator": self.algorithm.describe(),
            "steps": list(self.steps),
            "tokens": self.tokens,
            "passed": self.passed,
            "identities": [
                {
                    **{k: v for k, v in dataclasses.asdict(r).items() if k != "first"},
                    "notes": list(r.notes),
                    "first_violation": None
                    if r.first is None
                    else {**dataclasses.asdict(r.first), "text": str(r.first)},
                }
                for r in self.identities
            ],
        }


_PER_STEP_SCHEMA = pa.schema(
    [
        ("identity", pa.string()),
        ("step", pa.int64()),
        ("status", pa.string()),
        ("checked", pa.int64()),
        ("violations", pa.int64()),
        ("max_abs_error", pa.float64()),
        ("first_sample", pa.int64()),
        ("first_token_index", pa.int64()),
        ("first_violation", pa.string()),
        ("note", pa.string()),
    ]
)


def aggregate(identity: str, title: str, tolerance: str, results: list[StepResult]) -> IdentityResult:
    """One identity over all its steps: failed if any step failed, passed if any passed, else skipped."""
    statuses = {r.status for r in results}
    status = "fail" if "fail" in statuses else "pass" if "pass" in statuses else "skipped"
    errors = [r.max_abs_error for r in results if r.max_abs_error is not None]
    first = next((r.first for r in results if r.first is not None), None)
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
        max_abs_error=max(errors, key=lambda e: math.inf if math.isnan(e) else e) if errors else None,
        first=first,
        notes=notes,
    )


def _steps_text(steps: list[int], total: int) -> str:
    if len(steps) == total and total > 1:
        return "all steps"
    shown = ", ".join(str(s) for s in steps[:8]) + (", …" if len(steps) > 8 else "")
    return ("step " if len(steps) == 1 else "steps ") + shown

"""The identities of docs/definitions.md §8, checked on every traced step, as data.

For each step, on valid tokens, within the tolerances below:

1. ``advantage_raw``: returns − values = raw advantage where the estimator says so (one λ); else the
   raw advantage recomputed with the run's estimator.
2. ``whitening``: advantages = masked_whiten(raw advantage) over the step's batch (or = raw
   advantage when whitening is off); ``whitening_stats``: the recorded batch μ, σ² = recomputed.
3. ``returns``: returns recomputed from (rewards, values, mask) with the run's estimator.
4. ``rewards``: rewards = scores − β·kl with the step's β when KL is in the reward, else = scores.
5. ``mask_layout``: each sample's rows run 0…n−1 and end on a valid token (so no valid token
   follows a trailing pad); ``finite``: the run's quantities are present and finite on valid tokens.

Recomputation runs the registered estimator itself (:func:`verl_ext.registry.run`, the code path of
training) in float64 on the trace's float32 inputs, one dense row group of the step at a time; the
trace is read one step at a time, so memory is bounded by one step.

Tolerances. How far a traced number may be from its recomputation and still count as equal.

Traces store float32; the checker recomputes in float64 from those float32 inputs, so the
difference is the producer's own float32 rounding. Every tolerance here is

    ATOL + (a multiple of float32's ε) × (the magnitude of the numbers the producer combined),

so it scales with the data, and it is far below a real discrepancy: a single token changed by
1e-2 relative is caught (tests plant exactly that). The multiples, and why:

* elementwise identities (r = s − β·kl, raw = R − V): one or two float32 roundings of the operands,
  so 4ε·(|a| + |b|).
* recomputed returns and GAE advantages: the producer sums up to n terms in float32 (verl's
  Python loop over T, verl-ext's blocked scan). Rounding errors can pile up linearly: measured at
  up to 0.1·ε·n·m with n the terms summed and m the largest magnitude in the row (constant
  rewards, rows of 1k to 16k tokens), so the bound is ε·n·m (10x that worst case) plus 4ε·|expected|.
  n is the row's length L, or the estimator's horizon when shorter: 1 for td0, n for nstep,
  1/(1 − γλ) for GAE and 1/(1 − γ) for mc.
* whitening: the producer's batch mean and variance are float32 too; their error scales the
  whole token by 1/σ. Measured at up to 1.3e-7 × (|A| + (|x| + |μ|)/σ) for verl's and verl-ext's
  masked_whiten on 1M tokens; the bound is 16ε (≈ 1.9e-6) × (|A| + (|x| + |μ| + |R| + |V|)/σ),
  where |R| + |V| covers traces whose raw advantage was rebuilt as returns − values (verl's gae).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow as pa

from verl_ext.inspect import update
from verl_ext.inspect.stepdata import Progress, RecordedAlgorithm, StepData, as_trace, step_beta
from verl_ext.torch_threads import one_torch_thread

__all__ = ["IDENTITIES", "check_trace", "CheckReport", "IdentityResult", "Location", "StepResult", "Violation"]

# --------------------------------------------------------------------------- tolerances

EPS32 = float(np.finfo(np.float32).eps)  # 2^-23
#: Below this nothing is claimed: float32 data of order one round at ~6e-8.
ATOL = 1e-6
ELEMENTWISE = 4 * EPS32
ACCUMULATED = EPS32
WHITENING = 16 * EPS32


def elementwise_tolerance(scale: np.ndarray) -> np.ndarray:
    """Tolerance of an identity between float32 operands whose magnitudes add up to ``scale``."""
    return ATOL + ELEMENTWISE * scale


def accumulated_tolerance(expected: np.ndarray, terms: np.ndarray, magnitude: np.ndarray) -> np.ndarray:
    """Tolerance of a float32 sum of ``terms`` terms of at most ``magnitude`` each (per token)."""
    return ATOL + ELEMENTWISE * np.abs(expected) + ACCUMULATED * terms * magnitude


def whitening_tolerance(expected: np.ndarray, scale_over_sigma: np.ndarray) -> np.ndarray:
    """Tolerance of (x − μ)/σ given |A| and the operands' magnitude divided by σ."""
    return ATOL + WHITENING * (np.abs(expected) + scale_over_sigma)


ELEMENTWISE_TEXT = f"{ATOL:g} + 4ε·Σ|operand|"
ACCUMULATED_TEXT = f"{ATOL:g} + 4ε·|expected| + ε·n·m"
WHITENING_TEXT = f"{ATOL:g} + 16ε·(|A| + (|x|+|μ|+|R|+|V|)/σ)"
STATISTICS_TEXT = f"{ATOL:g} + 16ε·(|μ|+σ)"


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


# --------------------------------------------------------------------------- recomputation


@dataclass(frozen=True)
class Recomputed:
    """Returns and raw advantages recomputed at the step's valid tokens, with their tolerances."""

    returns: np.ndarray
    raw: np.ndarray
    returns_tolerance: np.ndarray
    raw_tolerance: np.ndarray


def recompute(algorithm: RecordedAlgorithm, data: StepData) -> Recomputed:
    """Returns and raw advantages at the step's valid tokens, as the run's estimator makes them."""
    with one_torch_thread():  # row groups are cache-sized: threads only contend
        return _recompute_groups(algorithm, data)


def _recompute_groups(algorithm: RecordedAlgorithm, data: StepData) -> Recomputed:
    layout = data.layout
    reward, value = data.columns["reward"], data.columns["value"]
    returns, raw = data.estimate(algorithm.estimator, algorithm.settings)
    # tolerances: the largest magnitude in each row (inputs and outputs) and the terms summed per row
    magnitude = np.maximum(np.abs(returns), np.abs(raw))
    for column in (reward, value):
        if column is not None:
            magnitude = np.maximum(magnitude, np.abs(column))
    nonempty = layout.valid_counts > 0
    row_magnitude = np.zeros(layout.samples)
    row_magnitude[nonempty] = np.maximum.reduceat(magnitude, layout.valid_starts[nonempty]) if len(magnitude) else 0.0
    lengths = layout.valid_counts.astype(np.float64)
    returns_horizon, raw_horizon = algorithm.estimator.horizons(algorithm.settings)
    token_sample = layout.valid_sample_index()
    row_magnitude = row_magnitude[token_sample]
    return Recomputed(
        returns,
        raw,
        accumulated_tolerance(returns, np.minimum(lengths, returns_horizon)[token_sample], row_magnitude),
        accumulated_tolerance(raw, np.minimum(lengths, raw_horizon)[token_sample], row_magnitude),
    )


# --------------------------------------------------------------------------- the identities


#: The identities of the token table, in report order (what each says depends on the run: see
#: ``_titles``); a trace with update tables adds :data:`update.UPDATE_IDENTITIES` after them.
IDENTITIES = (
    "advantage_raw",
    "whitening",
    "whitening_stats",
    "returns",
    "rewards",
    "mask_layout",
    "finite",
    "steps_on_disk",
)
QUANTITIES = ("score", "reward", "value", "return", "advantage", "advantage_raw", "kl", "old_log_prob")


def check_trace(trace, steps: Iterable[int] | None = None, progress: Progress | None = None) -> CheckReport:
    """Check every identity on every traced step (or on ``steps``) of a trace (open, or its path)."""
    trace = as_trace(trace)
    algorithm = RecordedAlgorithm.from_record(trace.record)
    selected = tuple(trace.steps if steps is None else steps)
    with_updates = any(trace.update_steps.values())  # a trace without update tables has no §8.6 rows
    per_step: list[StepResult] = []
    tokens = 0
    for done, step in enumerate(selected, start=1):
        data = StepData.read(trace, step, QUANTITIES)
        per_step.extend(_StepCheck(algorithm, trace.step_record(step), data).results())
        if with_updates:
            per_step.extend(_update_result(step, outcome) for outcome in update.check_update(trace, step, data))
        tokens += data.tokens
        if progress is not None:
            progress(done, len(selected), tokens)
    per_step.extend(_steps_on_disk(trace, selected, everything=steps is None))
    titles = _titles(algorithm)
    checked = IDENTITIES + update.UPDATE_IDENTITIES if with_updates else IDENTITIES
    identities = tuple(aggregate(key, *titles[key], [r for r in per_step if r.identity == key]) for key in checked)
    return CheckReport(str(trace.path), algorithm, selected, tokens, identities, tuple(per_step))


def _titles(algorithm: RecordedAlgorithm) -> dict[str, tuple[str, str]]:
    """(what the identity says, its tolerance) for this run."""
    accumulated = algorithm.recomputable and not algorithm.returns_minus_values
    whitening = (
        ("advantages = raw advantage (whitening off)", ELEMENTWISE_TEXT)
        if algorithm.whitened is False
        else ("advantages = masked_whiten(raw advantage)", WHITENING_TEXT)
    )
    rewards = "rewards = scores − β·kl" if algorithm.kl_in_reward else "rewards = scores (no KL in reward)"
    return {
        "advantage_raw": (
            f"raw advantage recomputed: {algorithm.describe_estimator()}"
            if accumulated
            else "raw advantage = returns − values",
            ACCUMULATED_TEXT if accumulated else ELEMENTWISE_TEXT,
        ),
        "whitening": whitening,
        "whitening_stats": ("recorded whitening μ, σ = recomputed", STATISTICS_TEXT),
        "returns": (f"returns recomputed: {algorithm.describe_estimator()}", ACCUMULATED_TEXT),
        "rewards": (rewards, ELEMENTWISE_TEXT),
        "mask_layout": ("rows 0…n−1 per sample, ending on a valid token", "exact"),
        "finite": ("quantities present and finite on valid tokens", "exact"),
        "steps_on_disk": ("every step and update table of the run record is on disk", "exact"),
        **{key: (update.TITLES[key], update.TOLERANCE_TEXT[key]) for key in update.UPDATE_IDENTITIES},
    }


def _steps_on_disk(trace, selected: tuple[int, ...], everything: bool) -> Iterator[StepResult]:
    """The run record's index against the files: a step or update table it lists must be on disk.
    (A step on disk that the record lacks is fine: the writer publishes data before the index.)"""
    recorded = {int(step): entry for step, entry in trace.record.steps.items()}
    for step in sorted(recorded if everything else set(recorded) & set(selected)):
        missing = [] if step in trace.steps else [recorded[step].file]
        missing += [u.file for kind, u in recorded[step].updates.items() if step not in trace.update_steps.get(kind, [])]
        first = Violation(Location(step), missing[0], detail="listed in the run record, missing on disk") if missing else None
        status = "fail" if missing else "pass"
        yield StepResult("steps_on_disk", step, status, checked=1, violations=len(missing), first=first)


def _update_result(step: int, outcome: "update.Outcome") -> StepResult:
    first = None
    if outcome.first is not None:
        f = outcome.first
        where = Location(step, f.get("sample"), f.get("token_index"))
        first = Violation(where, f["column"], f.get("actual"), f.get("expected"), f.get("error"), f.get("tolerance"), f.get("detail"))
    return StepResult(
        outcome.identity, step, outcome.status, checked=outcome.checked, violations=outcome.violations,
        max_abs_error=outcome.max_abs_error, first=first, note=outcome.note,
    )  # fmt: skip


class _StepCheck:
    """The identities on one step."""

    def __init__(self, algorithm: RecordedAlgorithm, step_record, data: StepData):
        self.algorithm = algorithm
        self.step_record = step_record
        self.data = data
        self.step = data.step
        self.col = data.columns
        self.recomputed = (
            recompute(algorithm, data) if algorithm.recomputable and self._inputs_present() else None
        )

    def results(self) -> Iterator[StepResult]:
        yield self.advantage_raw()
        yield self.whitening()
        yield self.whitening_stats()
        yield self.returns()
        yield self.rewards()
        yield self.mask_layout()
        yield self.finite()

    # ------------------------------------------------------------------ helpers

    def _inputs(self) -> tuple[str, ...]:
        """The columns the run's estimator computes from."""
        return ("reward", "value") if self.algorithm.estimator.needs_critic else ("reward",)

    def _inputs_present(self) -> bool:
        return all(self.col[name] is not None for name in self._inputs())

    def _skip(self, identity: str, why: str) -> StepResult:
        return StepResult(identity, self.step, "skipped", note=f"not applicable: {why}")

    def _missing(self, identity: str, names: Iterable[str]) -> StepResult | None:
        """A failed result when a column the identity needs is null everywhere."""
        missing = [name for name in names if self.col[name] is None]
        if not missing:
            return None
        detail = "null on every token of the step"
        first = Violation(Location(self.step), missing[0], detail=detail)
        return StepResult(
            identity, self.step, "fail", violations=1, first=first, note=f"{', '.join(missing)}: {detail}"
        )

    def _compare(
        self,
        identity: str,
        column: str,
        actual: np.ndarray,
        expected: np.ndarray,
        tol: np.ndarray,
        note: str | None = None,
    ) -> StepResult:
        error = np.abs(actual - expected)
        bad = ~(error <= tol)  # NaN is a violation
        violations = int(np.count_nonzero(bad))
        first = None
        if violations:
            i = int(np.argmax(bad))
            sample, token = self.data.location(i)
            where = Location(self.step, sample, token)
            if np.isfinite(actual[i]) and np.isfinite(expected[i]):
                tolerance = float(np.broadcast_to(tol, error.shape)[i])
                first = Violation(where, column, float(actual[i]), float(expected[i]), float(error[i]), tolerance)
            else:
                first = Violation(where, column, float(actual[i]), detail=f"not finite (expected {expected[i]:.7g})")
        return StepResult(
            identity, self.step, "fail" if violations else "pass", checked=len(error), violations=violations,
            max_abs_error=float(np.max(error)) if len(error) else None, first=first, note=note,
        )  # fmt: skip

    # ------------------------------------------------------------------ the identities

    def advantage_raw(self) -> StepResult:
        a = self.algorithm
        if not a.recomputable:
            return self._skip("advantage_raw", a.why_not)
        needed = ("advantage_raw", "return", "value") if a.returns_minus_values else ("advantage_raw", *self._inputs())
        if (missing := self._missing("advantage_raw", needed)) is not None:
            return missing
        raw, ret, value = self.col["advantage_raw"], self.col["return"], self.col["value"]
        if a.returns_minus_values:
            return self._compare(
                "advantage_raw", "advantage_raw", raw, ret - value, elementwise_tolerance(np.abs(ret) + np.abs(value))
            )
        expected, tol = self.recomputed.raw, self.recomputed.raw_tolerance
        return self._compare("advantage_raw", "advantage_raw", raw, expected, tol)

    def whitening(self) -> StepResult:
        a = self.algorithm
        if a.whitened is None:
            return self._skip("whitening", a.why_not)
        if (missing := self._missing("whitening", ("advantage", "advantage_raw"))) is not None:
            return missing
        advantage, raw = self.col["advantage"], self.col["advantage_raw"]
        if not a.whitened:
            return self._compare("whitening", "advantage", advantage, raw, elementwise_tolerance(np.abs(raw)))
        stats, note = self._whitening_stats_to_use()
        if stats is None:
            return StepResult("whitening", self.step, "skipped", note=note)
        mean, var = stats
        sigma = math.sqrt(var + 1e-8)
        expected = (raw - mean) / sigma
        operands = np.abs(raw) + abs(mean)
        for name in ("return", "value"):  # a raw advantage rebuilt as returns − values carries their rounding
            if self.col[name] is not None:  # (a non-finite one is identity 8.5's finding, not this one's)
                operands = operands + np.where(np.isfinite(self.col[name]), np.abs(self.col[name]), 0.0)
        return self._compare(
            "whitening", "advantage", advantage, expected, whitening_tolerance(expected, operands / sigma), note
        )

    @functools.cached_property
    def _raw_moments(self) -> tuple[float, float]:
        """μ, σ² of the step's raw advantages, computed here from the trace (independently of the
        statistics the capture recorded, which one identity compares them with)."""
        return _whitening_stats(self.col["advantage_raw"])

    def _truncation(self) -> tuple[int, int] | None:
        """(samples traced, samples in the batch) when the step kept only part of its batch. From the
        step record: a sample without any valid token has no rows, so the table cannot tell."""
        batch, samples = self.step_record.batch_samples, self.step_record.samples
        return (samples, batch) if isinstance(batch, int) and isinstance(samples, int) and batch > samples else None

    def _recorded_stats(self) -> tuple[float, float] | None:
        recorded = self.step_record.whiten
        if isinstance(recorded, dict) and all(isinstance(recorded.get(k), (int, float)) for k in ("mean", "var")):
            return float(recorded["mean"]), float(recorded["var"])
        return None

    def _whitening_stats_to_use(self) -> tuple[tuple[float, float] | None, str | None]:
        truncated = self._truncation()
        if truncated is not None:
            recorded = self._recorded_stats()
            if recorded is None:
                return None, f"traced {truncated[0]} of {truncated[1]} samples and no batch statistics recorded"
            return recorded, f"traced {truncated[0]} of {truncated[1]} samples: checked with the recorded batch μ, σ²"
        raw = self.col["advantage_raw"]
        if len(raw) < 2:
            return None, "fewer than two valid tokens: whitening is undefined"
        return self._raw_moments, None

    def whitening_stats(self) -> StepResult:
        if not self.algorithm.whitened:
            why = "whitening is off" if self.algorithm.whitened is False else self.algorithm.why_not
            return self._skip("whitening_stats", why)
        recorded = self._recorded_stats()
        if recorded is None:
            return StepResult("whitening_stats", self.step, "skipped", note="no whitening statistics recorded")
        truncated = self._truncation()
        if truncated is not None:
            note = f"traced {truncated[0]} of {truncated[1]} samples: the full batch's statistics cannot be recomputed"
            return StepResult("whitening_stats", self.step, "skipped", note=note)
        if (missing := self._missing("whitening_stats", ("advantage_raw",))) is not None:
            return missing
        if len(self.col["advantage_raw"]) < 2:
            return StepResult("whitening_stats", self.step, "skipped", note="fewer than two valid tokens")
        mean, var = self._raw_moments
        actual = np.array([recorded[0], math.sqrt(max(recorded[1], 0.0))])
        expected = np.array([mean, math.sqrt(var)])
        tol = whitening_tolerance(0.0, abs(mean) + math.sqrt(var))
        error = np.abs(actual - expected)
        bad = ~(error <= tol)
        first = None
        if bad.any():
            i = int(np.argmax(bad))
            first = Violation(
                Location(self.step),
                ("whiten.mean", "whiten.σ")[i],
                *map(float, (actual[i], expected[i], error[i], tol)),
            )
        return StepResult(
            "whitening_stats", self.step, "fail" if first else "pass", checked=2, violations=int(bad.sum()),
            max_abs_error=float(error.max()), first=first,
        )  # fmt: skip

    def returns(self) -> StepResult:
        a = self.algorithm
        if not a.recomputable:
            return self._skip("returns", a.why_not)
        if (missing := self._missing("returns", ("return", *self._inputs()))) is not None:
            return missing
        r = self.recomputed
        return self._compare("returns", "return", self.col["return"], r.returns, r.returns_tolerance)

    def rewards(self) -> StepResult:
        if (missing := self._missing("rewards", ("reward", "score"))) is not None:
            return missing
        reward, score = self.col["reward"], self.col["score"]
        if not self.algorithm.kl_in_reward:
            return self._compare("rewards", "reward", reward, score, elementwise_tolerance(np.abs(score)))
        beta = step_beta(self.step_record)
        if beta is None:
            detail = "KL is in the reward but the run record has no β (kl_coef) for this step"
            first = Violation(Location(self.step), "kl_coef", detail=detail)
            return StepResult("rewards", self.step, "fail", violations=1, first=first, note=detail)
        if (missing := self._missing("rewards", ("kl",))) is not None:
            return missing
        penalty = beta * self.col["kl"]
        return self._compare(
            "rewards", "reward", reward, score - penalty, elementwise_tolerance(np.abs(score) + np.abs(penalty)),
            note=f"β = {beta:g}",
        )  # fmt: skip

    def mask_layout(self) -> StepResult:
        problems = list(self.data.layout.problems())
        first = None
        if problems:
            row, message, _ = min(problems)
            sample, token = self.data.row_location(row)
            first = Violation(Location(self.step, sample, token), "mask", detail=message)
        violations = sum(count for _, _, count in problems)
        return StepResult(
            "mask_layout", self.step, "fail" if problems else "pass", checked=len(self.data.layout.mask),
            violations=violations, first=first,
        )  # fmt: skip

    def finite(self) -> StepResult:
        a = self.algorithm
        required = {"score", "reward", "return", "advantage"}
        if a.recomputable:
            required |= {"advantage_raw", *self._inputs()}
        if a.kl_in_reward:
            required.add("kl")
        names = [name for name in QUANTITIES if name in required or self.col[name] is not None]
        if (missing := self._missing("finite", [n for n in names if n in required])) is not None:
            return missing
        first_row, first = None, None
        violations = 0
        for name in names:
            values = self.col[name]
            if values is None:
                continue
            bad = np.flatnonzero(~np.isfinite(values))
            violations += len(bad)
            if len(bad) and (first_row is None or bad[0] < first_row):
                first_row = int(bad[0])
                sample, token = self.data.location(first_row)
                detail = "null" if self.data.is_null(name, first_row) else "not finite"
                first = Violation(Location(self.step, sample, token), name, float(values[first_row]), detail=detail)
        checked = sum(len(self.col[n]) for n in names if self.col[n] is not None)
        return StepResult(
            "finite", self.step, "fail" if violations else "pass", checked=checked, violations=violations, first=first
        )


def _whitening_stats(x: np.ndarray) -> tuple[float, float]:
    """verl's masked_whiten statistics: μ = Σx/(n+1e-8), σ² = Σ(x−μ)²/(n+1e-8)·n/(n−1)."""
    n = len(x)
    mean = float(x.sum() / (n + 1e-8))
    var = float(np.square(x - mean).sum() / (n + 1e-8) * (n / (n - 1)))
    return mean, var

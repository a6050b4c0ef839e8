"""The identities of docs/definitions.md §8, checked on every traced step, as data.

For each step, on valid tokens, within the tolerances of :mod:`verl_ext.inspect.tolerance`:

1. ``advantage_raw``: returns − values = raw advantage (one λ); with decoupled or length-adaptive
   λ, raw advantage = GAE(γ, λ_actor) recomputed.
2. ``whitening``: advantages = masked_whiten(raw advantage) over the step's batch (or = raw
   advantage when whitening is off); ``whitening_stats``: the recorded batch μ, σ² = recomputed.
3. ``returns``: returns recomputed from (rewards, values, mask) with the run's estimator.
4. ``rewards``: rewards = scores − β·kl with the step's β when KL is in the reward, else = scores.
5. ``mask_layout``: each sample's rows run 0…n−1 and end on a valid token (so no valid token
   follows a trailing pad); ``finite``: the run's quantities are present and finite on valid tokens.

Recomputation uses :func:`verl_ext.estimators.estimate` in float64 on the trace's float32 inputs,
row group by row group; the trace is read one step at a time, so memory is bounded by one step.
"""

from __future__ import annotations

import functools

import math
from typing import Iterable, Iterator

import numpy as np

from verl_ext.inspect import tolerance
from verl_ext.inspect.progress import Progress
from verl_ext.inspect.recompute import recompute
from verl_ext.inspect.recorded import RecordedAlgorithm, step_beta
from verl_ext.inspect.report import CheckReport, IdentityResult, Location, StepResult, Violation, aggregate
from verl_ext.inspect.source import as_trace
from verl_ext.inspect.stepdata import StepData

__all__ = ["IDENTITIES", "check_trace", "CheckReport", "IdentityResult", "Location", "StepResult", "Violation"]

#: The identities, in report order (what each says depends on the run: see ``_titles``).
IDENTITIES = (
    "advantage_raw",
    "whitening",
    "whitening_stats",
    "returns",
    "rewards",
    "mask_layout",
    "finite",
)
QUANTITIES = ("score", "reward", "value", "return", "advantage", "advantage_raw", "kl")


def check_trace(trace, steps: Iterable[int] | None = None, progress: Progress | None = None) -> CheckReport:
    """Check every identity on every traced step (or on ``steps``) of a trace (open, or its path)."""
    trace = as_trace(trace)
    algorithm = RecordedAlgorithm.from_record(trace.record)
    selected = tuple(trace.steps if steps is None else steps)
    per_step: list[StepResult] = []
    tokens = 0
    for done, step in enumerate(selected, start=1):
        data = StepData.read(trace, step, QUANTITIES)
        per_step.extend(_StepCheck(algorithm, trace.step_record(step), data).results())
        tokens += data.tokens
        if progress is not None:
            progress(done, len(selected), tokens)
    titles = _titles(algorithm)
    identities = tuple(aggregate(key, *titles[key], [r for r in per_step if r.identity == key]) for key in IDENTITIES)
    return CheckReport(str(trace.path), algorithm, selected, tokens, identities, tuple(per_step))


def _titles(algorithm: RecordedAlgorithm) -> dict[str, tuple[str, str]]:
    """(what the identity says, its tolerance) for this run."""
    accumulated = algorithm.options is not None and not algorithm.single_lambda
    whitening = (
        ("advantages = raw advantage (whitening off)", tolerance.ELEMENTWISE_TEXT)
        if algorithm.whitened is False
        else ("advantages = masked_whiten(raw advantage)", tolerance.WHITENING_TEXT)
    )
    rewards = "rewards = scores − β·kl" if algorithm.kl_in_reward else "rewards = scores (no KL in reward)"
    return {
        "advantage_raw": (
            algorithm.raw_formula(),
            tolerance.ACCUMULATED_TEXT if accumulated else tolerance.ELEMENTWISE_TEXT,
        ),
        "whitening": whitening,
        "whitening_stats": ("recorded whitening μ, σ = recomputed", tolerance.STATISTICS_TEXT),
        "returns": (algorithm.returns_formula(), tolerance.ACCUMULATED_TEXT),
        "rewards": (rewards, tolerance.ELEMENTWISE_TEXT),
        "mask_layout": ("rows 0…n−1 per sample, ending on a valid token", "exact"),
        "finite": ("quantities present and finite on valid tokens", "exact"),
    }


class _StepCheck:
    """The identities on one step."""

    def __init__(self, algorithm: RecordedAlgorithm, step_record: dict, data: StepData):
        self.algorithm = algorithm
        self.step_record = step_record
        self.data = data
        self.step = data.step
        self.col = data.columns
        self.recomputed = (
            recompute(algorithm, data) if algorithm.options is not None and self._inputs_present() else None
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

    def _inputs_present(self) -> bool:
        return all(self.col[name] is not None for name in ("reward", "value"))

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
            first = Violation(
                Location(self.step, sample, token), column, float(actual[i]), float(expected[i]), float(error[i]),
                float(np.broadcast_to(tol, error.shape)[i]),
            )  # fmt: skip
        return StepResult(
            identity, self.step, "fail" if violations else "pass", checked=len(error), violations=violations,
            max_abs_error=float(np.max(error)) if len(error) else None, first=first, note=note,
        )  # fmt: skip

    # ------------------------------------------------------------------ the identities

    def advantage_raw(self) -> StepResult:
        a = self.algorithm
        if a.options is None:
            return self._skip("advantage_raw", a.why_not)
        needed = ("advantage_raw", "return", "value") if a.single_lambda else ("advantage_raw", "reward", "value")
        if (missing := self._missing("advantage_raw", needed)) is not None:
            return missing
        raw, ret, value = self.col["advantage_raw"], self.col["return"], self.col["value"]
        if a.single_lambda:
            return self._compare(
                "advantage_raw", "advantage_raw", raw, ret - value, tolerance.elementwise(np.abs(ret) + np.abs(value))
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
            return self._compare("whitening", "advantage", advantage, raw, tolerance.elementwise(np.abs(raw)))
        stats, note = self._whitening_stats_to_use()
        if stats is None:
            return StepResult("whitening", self.step, "skipped", note=note)
        mean, var = stats
        sigma = math.sqrt(var + 1e-8)
        expected = (raw - mean) / sigma
        operands = np.abs(raw) + abs(mean)
        for name in ("return", "value"):  # a raw advantage rebuilt as returns − values carries their rounding
            if self.col[name] is not None:
                operands = operands + np.abs(self.col[name])
        return self._compare(
            "whitening", "advantage", advantage, expected, tolerance.whitening(expected, operands / sigma), note
        )

    @functools.cached_property
    def _raw_moments(self) -> tuple[float, float]:
        """μ, σ² of the step's raw advantages, computed here from the trace (independently of the
        statistics the capture recorded, which one identity compares them with)."""
        return _whitening_stats(self.col["advantage_raw"])

    def _truncation(self) -> tuple[int, int] | None:
        """(samples traced, samples in the batch) when the step kept only part of its batch. From the
        step record: a sample without any valid token has no rows, so the table cannot tell."""
        batch = self.step_record.get("batch_samples")
        samples = self.step_record.get("samples", self.data.layout.samples)
        return (samples, batch) if isinstance(batch, int) and isinstance(samples, int) and batch > samples else None

    def _recorded_stats(self) -> tuple[float, float] | None:
        recorded = self.step_record.get("whiten")
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
        tol = tolerance.whitening(0.0, abs(mean) + math.sqrt(var))
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
        if a.options is None:
            return self._skip("returns", a.why_not)
        if (missing := self._missing("returns", ("return", "reward", "value"))) is not None:
            return missing
        r = self.recomputed
        return self._compare("returns", "return", self.col["return"], r.returns, r.returns_tolerance)

    def rewards(self) -> StepResult:
        if (missing := self._missing("rewards", ("reward", "score"))) is not None:
            return missing
        reward, score = self.col["reward"], self.col["score"]
        if not self.algorithm.kl_in_reward:
            return self._compare("rewards", "reward", reward, score, tolerance.elementwise(np.abs(score)))
        beta = step_beta(self.step_record)
        if beta is None:
            detail = "KL is in the reward but the run record has no β (kl_coef) for this step"
            first = Violation(Location(self.step), "kl_coef", detail=detail)
            return StepResult("rewards", self.step, "fail", violations=1, first=first, note=detail)
        if (missing := self._missing("rewards", ("kl",))) is not None:
            return missing
        penalty = beta * self.col["kl"]
        return self._compare(
            "rewards", "reward", reward, score - penalty, tolerance.elementwise(np.abs(score) + np.abs(penalty)),
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
        if a.options is not None:
            required |= {"value", "advantage_raw"}
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

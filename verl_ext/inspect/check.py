"""The identities of docs/definitions.md §8, checked on every traced step, as data.

:data:`IDENTITIES` is the one list of them, in report order: each an
:class:`~verl_ext.inspect.identities.Identity` record (name, section, table, title, tolerance, check).
The token table's checks are here, the update tables' in :mod:`verl_ext.inspect.update`.

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
from verl_ext.inspect.identities import (
    ATOL,
    ELEMENTWISE,
    EPS32,
    EXACT,
    RUN,
    TOKEN,
    UPDATE,
    Finding,
    Identity,
    IdentityResult,
    Location,
    StepResult,
    Tolerance,
    Violation,
    aggregate,
    compare,
    skipped,
)
from verl_ext.inspect.stepdata import Progress, RecordedAlgorithm, StepData, as_trace, step_beta
from verl_ext.torch_threads import one_torch_thread

__all__ = ["IDENTITIES", "check_trace", "CheckReport", "IdentityResult", "Location", "StepResult", "Violation"]

# --------------------------------------------------------------------------- tolerances

#: The whitening bound's multiple of ε (measured at 1.3e-7 of the scale, see above).
WHITENING_FACTOR = 16 * EPS32
#: A float32 sum of ``terms`` terms of at most ``magnitude`` each (per token).
ACCUMULATED = Tolerance(
    f"{ATOL:g} + 4ε·|expected| + ε·n·m",
    lambda expected, terms, magnitude: ATOL + 4 * EPS32 * np.abs(expected) + EPS32 * terms * magnitude,
)
#: (x − μ)/σ given |A| and the operands' magnitude divided by σ.
WHITENING = Tolerance(
    f"{ATOL:g} + 16ε·(|A| + (|x|+|μ|+|R|+|V|)/σ)",
    lambda expected, scale_over_sigma: ATOL + WHITENING_FACTOR * (np.abs(expected) + scale_over_sigma),
)
#: The batch statistics μ and σ of whitening.
STATISTICS = Tolerance(f"{ATOL:g} + 16ε·(|μ|+σ)", lambda mean, sigma: ATOL + WHITENING_FACTOR * (abs(mean) + sigma))


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
        ACCUMULATED(returns, np.minimum(lengths, returns_horizon)[token_sample], row_magnitude),
        ACCUMULATED(raw, np.minimum(lengths, raw_horizon)[token_sample], row_magnitude),
    )


# --------------------------------------------------------------------------- the token table's identities


class _StepCheck:
    """The token table's identities on one step: each method is the check of one Identity record."""

    def __init__(self, algorithm: RecordedAlgorithm, step_record, data: StepData):
        self.algorithm = algorithm
        self.step_record = step_record
        self.data = data
        self.step = data.step
        self.col = data.columns
        self.recomputed = (
            recompute(algorithm, data) if algorithm.recomputable and self._inputs_present() else None
        )

    # ------------------------------------------------------------------ helpers

    def _inputs(self) -> tuple[str, ...]:
        """The columns the run's estimator computes from."""
        return ("reward", "value") if self.algorithm.estimator.needs_critic else ("reward",)

    def _inputs_present(self) -> bool:
        return all(self.col[name] is not None for name in self._inputs())

    def _missing(self, names: Iterable[str]) -> Finding | None:
        """A failed finding when a column the identity needs is null everywhere."""
        missing = [name for name in names if self.col[name] is None]
        if not missing:
            return None
        detail = "null on every token of the step"
        first = Violation(Location(self.step), missing[0], detail=detail)
        return Finding("fail", violations=1, first=first, note=f"{', '.join(missing)}: {detail}")

    def _compare(self, column: str, actual, expected, tolerance, note: str | None = None) -> Finding:
        return compare(actual, expected, tolerance, lambda i: (Location(self.step, *self.data.location(i)), column), note)

    # ------------------------------------------------------------------ the identities

    def advantage_raw(self) -> Finding:
        a = self.algorithm
        if not a.recomputable:
            return skipped(a.why_not)
        needed = ("advantage_raw", "return", "value") if a.returns_minus_values else ("advantage_raw", *self._inputs())
        if (missing := self._missing(needed)) is not None:
            return missing
        raw, ret, value = self.col["advantage_raw"], self.col["return"], self.col["value"]
        if a.returns_minus_values:
            return self._compare("advantage_raw", raw, ret - value, ELEMENTWISE(np.abs(ret) + np.abs(value)))
        return self._compare("advantage_raw", raw, self.recomputed.raw, self.recomputed.raw_tolerance)

    def whitening(self) -> Finding:
        a = self.algorithm
        if a.whitened is None:
            return skipped(a.why_not)
        if (missing := self._missing(("advantage", "advantage_raw"))) is not None:
            return missing
        advantage, raw = self.col["advantage"], self.col["advantage_raw"]
        if not a.whitened:
            return self._compare("advantage", advantage, raw, ELEMENTWISE(np.abs(raw)))
        stats, note = self._whitening_stats_to_use()
        if stats is None:
            return Finding("skipped", note=note)
        mean, var = stats
        sigma = math.sqrt(var + 1e-8)
        expected = (raw - mean) / sigma
        operands = np.abs(raw) + abs(mean)
        for name in ("return", "value"):  # a raw advantage rebuilt as returns − values carries their rounding
            if self.col[name] is not None:  # (a non-finite one is identity 8.5's finding, not this one's)
                operands = operands + np.where(np.isfinite(self.col[name]), np.abs(self.col[name]), 0.0)
        return self._compare("advantage", advantage, expected, WHITENING(expected, operands / sigma), note)

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

    def whitening_stats(self) -> Finding:
        if not self.algorithm.whitened:
            return skipped("whitening is off" if self.algorithm.whitened is False else self.algorithm.why_not)
        recorded = self._recorded_stats()
        if recorded is None:
            return Finding("skipped", note="no whitening statistics recorded")
        truncated = self._truncation()
        if truncated is not None:
            note = f"traced {truncated[0]} of {truncated[1]} samples: the full batch's statistics cannot be recomputed"
            return Finding("skipped", note=note)
        if (missing := self._missing(("advantage_raw",))) is not None:
            return missing
        if len(self.col["advantage_raw"]) < 2:
            return Finding("skipped", note="fewer than two valid tokens")
        mean, var = self._raw_moments
        actual = [recorded[0], math.sqrt(max(recorded[1], 0.0))]
        expected = [mean, math.sqrt(var)]
        names = ("whiten.mean", "whiten.σ")
        return compare(actual, expected, STATISTICS(mean, math.sqrt(var)), lambda i: (Location(self.step), names[i]))

    def returns(self) -> Finding:
        a = self.algorithm
        if not a.recomputable:
            return skipped(a.why_not)
        if (missing := self._missing(("return", *self._inputs()))) is not None:
            return missing
        r = self.recomputed
        return self._compare("return", self.col["return"], r.returns, r.returns_tolerance)

    def rewards(self) -> Finding:
        if (missing := self._missing(("reward", "score"))) is not None:
            return missing
        reward, score = self.col["reward"], self.col["score"]
        if not self.algorithm.kl_in_reward:
            return self._compare("reward", reward, score, ELEMENTWISE(np.abs(score)))
        beta = step_beta(self.step_record)
        if beta is None:
            detail = "KL is in the reward but the run record has no β (kl_coef) for this step"
            return Finding("fail", violations=1, first=Violation(Location(self.step), "kl_coef", detail=detail), note=detail)
        if (missing := self._missing(("kl",))) is not None:
            return missing
        penalty = beta * self.col["kl"]
        tolerance = ELEMENTWISE(np.abs(score) + np.abs(penalty))
        return self._compare("reward", reward, score - penalty, tolerance, note=f"β = {beta:g}")

    def mask_layout(self) -> Finding:
        problems = list(self.data.layout.problems())
        first = None
        if problems:
            row, message, _ = min(problems)
            sample, token = self.data.row_location(row)
            first = Violation(Location(self.step, sample, token), "mask", detail=message)
        violations = sum(count for _, _, count in problems)
        return Finding(
            "fail" if problems else "pass", checked=len(self.data.layout.mask), violations=violations, first=first
        )

    def finite(self) -> Finding:
        a = self.algorithm
        required = {"score", "reward", "return", "advantage"}
        if a.recomputable:
            required |= {"advantage_raw", *self._inputs()}
        if a.kl_in_reward:
            required.add("kl")
        names = [name for name in QUANTITIES if name in required or self.col[name] is not None]
        if (missing := self._missing([n for n in names if n in required])) is not None:
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
        return Finding("fail" if violations else "pass", checked=checked, violations=violations, first=first)


def _whitening_stats(x: np.ndarray) -> tuple[float, float]:
    """verl's masked_whiten statistics: μ = Σx/(n+1e-8), σ² = Σ(x−μ)²/(n+1e-8)·n/(n−1)."""
    n = len(x)
    mean = float(x.sum() / (n + 1e-8))
    var = float(np.square(x - mean).sum() / (n + 1e-8) * (n / (n - 1)))
    return mean, var


@dataclass(frozen=True)
class _Run:
    """What the RUN identities read: the trace and which of its steps are checked."""

    trace: Any
    selected: tuple[int, ...]
    everything: bool


def _steps_on_disk(run: _Run) -> Iterator[tuple[int, Finding]]:
    """The run record's index against the files: a step or update table it lists must be on disk.
    (A step on disk that the record lacks is fine: the writer publishes data before the index.)"""
    trace = run.trace
    recorded = {int(step): entry for step, entry in trace.record.steps.items()}
    for step in sorted(recorded if run.everything else set(recorded) & set(run.selected)):
        missing = [] if step in trace.steps else [recorded[step].file]
        missing += [u.file for kind, u in recorded[step].updates.items() if step not in trace.update_steps.get(kind, [])]
        first = Violation(Location(step), missing[0], detail="listed in the run record, missing on disk") if missing else None
        yield step, Finding("fail" if missing else "pass", checked=1, violations=len(missing), first=first)


# --------------------------------------------------------------------------- the registry


def _accumulated(a: RecordedAlgorithm) -> bool:
    """The raw advantage is recomputed with the estimator (else it is checked as returns − values)."""
    return a.recomputable and not a.returns_minus_values


#: Every identity, in report order: the token table's on each step, the run record's once, then the
#: update tables' on each step (only for a trace that has update tables). To add one: write its check
#: (a method of ``_StepCheck`` for the token table, a function of ``update.UpdateStep`` for the update
#: tables) and add its record here; it is checked, reported and rendered from the record alone.
IDENTITIES = (
    Identity(
        "advantage_raw", "8.1", TOKEN,
        lambda a: f"raw advantage recomputed: {a.describe_estimator()}" if _accumulated(a) else "raw advantage = returns − values",
        lambda a: ACCUMULATED if _accumulated(a) else ELEMENTWISE,
        _StepCheck.advantage_raw,
    ),
    Identity(
        "whitening", "8.2", TOKEN,
        lambda a: "advantages = raw advantage (whitening off)" if a.whitened is False else "advantages = masked_whiten(raw advantage)",
        lambda a: ELEMENTWISE if a.whitened is False else WHITENING,
        _StepCheck.whitening,
    ),
    Identity("whitening_stats", "8.2", TOKEN, "recorded whitening μ, σ = recomputed", STATISTICS, _StepCheck.whitening_stats, counts="statistic"),
    Identity("returns", "8.3", TOKEN, lambda a: f"returns recomputed: {a.describe_estimator()}", ACCUMULATED, _StepCheck.returns),
    Identity(
        "rewards", "8.4", TOKEN,
        lambda a: "rewards = scores − β·kl" if a.kl_in_reward else "rewards = scores (no KL in reward)",
        ELEMENTWISE, _StepCheck.rewards,
    ),
    Identity("mask_layout", "8.5", TOKEN, "rows 0…n−1 per sample, ending on a valid token", EXACT, _StepCheck.mask_layout, counts="row"),
    Identity("finite", "8.5", TOKEN, "quantities present and finite on valid tokens", EXACT, _StepCheck.finite),
    Identity("steps_on_disk", "8.5", RUN, "every step and update table of the run record is on disk", EXACT, _steps_on_disk, counts="file"),
    *update.IDENTITIES,
)  # fmt: skip
QUANTITIES = ("score", "reward", "value", "return", "advantage", "advantage_raw", "kl", "old_log_prob")


# --------------------------------------------------------------------------- the check


def check_trace(trace, steps: Iterable[int] | None = None, progress: Progress | None = None) -> CheckReport:
    """Check every identity on every traced step (or on ``steps``) of a trace (open, or its path)."""
    trace = as_trace(trace)
    algorithm = RecordedAlgorithm.from_record(trace.record)
    selected = tuple(trace.steps if steps is None else steps)
    with_updates = any(trace.update_steps.values())  # a trace without update tables has no §8.6 rows
    checked = [i for i in IDENTITIES if i.table != UPDATE or with_updates]
    per_step: list[StepResult] = []
    tokens = 0
    for done, step in enumerate(selected, start=1):
        data = StepData.read(trace, step, QUANTITIES)
        contexts = {TOKEN: _StepCheck(algorithm, trace.step_record(step), data)}
        if with_updates:
            contexts[UPDATE] = update.UpdateStep(trace, step, data)
        for i in checked:
            if i.table != RUN:
                per_step.append(StepResult(**vars(i.check(contexts[i.table])), identity=i.name, step=step))
        tokens += data.tokens
        if progress is not None:
            progress(done, len(selected), tokens)
    run = _Run(trace, selected, everything=steps is None)
    for i in checked:
        if i.table == RUN:
            per_step.extend(StepResult(**vars(finding), identity=i.name, step=step) for step, finding in i.check(run))
    identities = tuple(
        aggregate(i.name, *i.describe(algorithm), [r for r in per_step if r.identity == i.name]) for i in checked
    )
    return CheckReport(str(trace.path), algorithm, selected, tokens, identities, tuple(per_step))


# --------------------------------------------------------------------------- the report


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

    def definition(self, identity: str) -> Identity:
        """The record of one of the report's identities (its section, what a violation counts)."""
        return next(record for record in IDENTITIES if record.name == identity)

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

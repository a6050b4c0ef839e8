"""The token table's identities of docs/definitions.md §8 (items 1–5 and 7), and the run record's
index against the files: the checks their records in :mod:`verl_ext.check.identities` name, within
the tolerances of docs/definitions.md#tolerances (:mod:`verl_ext.check.results` computes them).

Recomputation runs the registered estimator itself (:func:`verl_ext.registry.run`, the code path of
training) in float64 on the trace's float32 inputs, one dense row group of the step at a time; the
trace is read one step at a time, so memory is bounded by one step.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np
import pyarrow.compute as pc

from verl_ext.check.results import ATOL, DTYPE_EPS, ELEMENTWISE, EPS32, Finding, Location, Tolerance, Violation, compare, skipped, unchecked
from verl_ext.steps.as_run import as_run
from verl_ext.steps.cuts import SECTION as TRUNCATION_SECTION
from verl_ext.steps.cuts import STOPPED_AT_LENGTH, StepCuts
from verl_ext.steps.layout import StepData, floats
from verl_ext.steps.recorded import RecordedAlgorithm, step_beta
from verl_ext.torch_threads import one_torch_thread
from verl_ext.trace.schema import ROLE_ASSISTANT, since

#: The token-table columns the identities read.
QUANTITIES = (
    "score", "reward", "value", "return", "advantage", "advantage_raw", "kl", "old_log_prob", "turn_score", "tool_reward",
    "rollout_log_prob", "rollout_is_weight",
)  # fmt: skip
#: The per-turn rewards added to the scores (verl_ext.turn_rewards, docs/definitions.md §7), by source.
TURN_REWARDS = ("turn_score", "tool_reward")

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


def recompute(algorithm: RecordedAlgorithm, data: StepData, cuts: StepCuts | None = None) -> Recomputed:
    """Returns and raw advantages at the step's valid tokens, as the run's estimator makes them
    (under the run's truncation, with ``cuts``: the step's recorded cut responses and V(s_L))."""
    with one_torch_thread():  # row groups are cache-sized: threads only contend
        return _recompute_groups(algorithm, data, cuts)


def _recompute_groups(algorithm: RecordedAlgorithm, data: StepData, cuts: StepCuts | None) -> Recomputed:
    layout = data.layout
    reward, value = data.columns["reward"], data.columns["value"]
    # as the run made them (a bootstrap the step cannot give is never recomputed: TokenStep; a mask
    # without cut flags has the terminal returns and raw advantages, which are the mask's)
    estimate = as_run(data, algorithm, cuts)
    returns, raw = estimate.returns, estimate.advantage_raw
    # tolerances: the largest magnitude in each row (inputs and outputs) and the terms summed per row
    magnitude = np.maximum(np.abs(returns), np.abs(raw))
    for column in (reward, value):
        if column is not None:
            magnitude = np.maximum(magnitude, np.abs(column))
    nonempty = layout.valid_counts > 0
    row_magnitude = np.zeros(layout.samples)
    row_magnitude[nonempty] = np.maximum.reduceat(magnitude, layout.valid_starts[nonempty]) if len(magnitude) else 0.0
    if algorithm.truncation == "bootstrap" and cuts is not None and cuts.bootstrap_value is not None:
        # the producer added γ·V(s_L) to the last reward of a cut row: V(s_L) is one of its operands
        bootstrap = np.where(cuts.cut & np.isfinite(cuts.bootstrap_value), np.abs(cuts.bootstrap_value), 0.0)
        row_magnitude = np.maximum(row_magnitude, bootstrap)
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


class TokenStep:
    """The token table's identities on one step: each method is the check of one identity."""

    def __init__(self, algorithm: RecordedAlgorithm, step_record, data: StepData, cuts: StepCuts | None = None):
        """``cuts``: the step's cut responses, V(s_L) and the engine's stop reasons, from its prompt table
        (:meth:`StepCuts.of`); the recomputation reads the first two for a run whose truncation is not terminal."""
        self.algorithm = algorithm
        self.step_record = step_record
        self.data = data
        self.step = data.step
        self.col = data.columns
        self.cuts = cuts
        #: why the step's truncation cannot be recomputed (no flags, a cut response without V(s_L)), or None
        self.cut_problem = None if algorithm.truncation == "terminal" else (
            f"the trace's prompt table is not read ({TRUNCATION_SECTION})" if cuts is None else cuts.why_not(algorithm.truncation)
        )  # fmt: skip
        self.recomputed = (
            recompute(algorithm, data, cuts if algorithm.truncation != "terminal" else None)
            if algorithm.recomputable and self._inputs_present() and not self._returns_need_cuts()
            else None
        )

    # ------------------------------------------------------------------ helpers

    @property
    def correction(self):
        """The run's rollout correction (:class:`verl_ext.rollout_correction.Correction`), or None."""
        return self.algorithm.correction

    def _inputs(self) -> tuple[str, ...]:
        """The columns the run's estimator computes from."""
        return ("reward", "value") if self.algorithm.estimator.needs_critic else ("reward",)

    def _inputs_present(self) -> bool:
        return all(self.col[name] is not None for name in self._inputs())

    def _returns_need_cuts(self) -> bool:
        """The returns depend on what the step cannot say: a bootstrap whose V(s_L) or cut is unknown."""
        return self.algorithm.truncation == "bootstrap" and self.cut_problem is not None

    def _cut_tokens(self) -> np.ndarray:
        """(N,) bool at the valid tokens: the token's response was cut (none where the step cannot say)."""
        cuts = self.cuts
        if cuts is None or cuts.cut is None:
            return np.zeros(self.data.tokens, bool)
        return cuts.at_tokens(self.data.layout)

    def _whitened_tokens(self) -> np.ndarray | None:
        """The valid tokens the whitening statistics are over: all, or the responses not cut (mask)."""
        return ~self._cut_tokens() if self.algorithm.truncation == "mask" else None

    def _missing(self, names: Iterable[str]) -> Finding | None:
        """A failed finding when a column the identity needs is null everywhere."""
        missing = [name for name in names if self.col[name] is None]
        if not missing:
            return None
        detail = "null on every token of the step"
        first = Violation(Location(self.step), missing[0], detail=detail)
        return Finding("fail", violations=1, first=first, note=f"{', '.join(missing)}: {detail}")

    def _without_estimator(self) -> Finding:
        """An identity that needs the run's estimator when this process has none: not checked when
        the estimator is missing here (its module did not import), not applicable to verl's
        estimators whose advantages come from statistics the trace does not hold."""
        a = self.algorithm
        return unchecked(a.why_not) if a.estimator_missing else skipped(a.why_not)

    def _held_in(self, column: str) -> str | None:
        """The dtype below float32 the trainer held ``column`` in at this step (its entry's ``stored_dtypes``), or None."""
        return (getattr(self.step_record, "stored_dtypes", None) or {}).get(column)

    def _compare(self, column: str, actual, expected, tolerance, note: str | None = None) -> Finding:
        if held := self._held_in(column):  # the trainer rounded its result to that dtype: half an ulp more (docs/definitions.md#in-a-bf16-run)
            tolerance = tolerance + DTYPE_EPS.get(held, EPS32) / 2 * np.abs(np.asarray(expected, np.float64))
            said = f"{column} held in {held} by the trainer: + ε/2·|{column}|"
            note = said if note is None else f"{note}; {said}"
        return compare(actual, expected, tolerance, lambda i: (Location(self.step, *self.data.location(i)), column), note)

    # ------------------------------------------------------------------ the identities

    def advantage_raw(self) -> Finding:
        a = self.algorithm
        if not a.recomputable:
            return self._without_estimator()
        needed = ("advantage_raw", "return", "value") if a.returns_minus_values else ("advantage_raw", *self._inputs())
        if (missing := self._missing(needed)) is not None:
            return missing
        raw, ret, value = self.col["advantage_raw"], self.col["return"], self.col["value"]
        if a.returns_minus_values:
            return self._compare("advantage_raw", raw, ret - value, ELEMENTWISE(np.abs(ret) + np.abs(value)))
        if self._returns_need_cuts():
            return unchecked(self.cut_problem)
        return self._compare("advantage_raw", raw, self.recomputed.raw, self.recomputed.raw_tolerance)

    def whitening(self) -> Finding:
        a = self.algorithm
        if a.whitened is None:
            return self._without_estimator()
        if (missing := self._missing(("advantage", "advantage_raw"))) is not None:
            return missing
        advantage, raw = self.col["advantage"], self.col["advantage_raw"]
        if a.truncation == "mask" and self.cut_problem is not None:
            return unchecked(self.cut_problem)
        cut = self._cut_tokens() if a.truncation == "mask" else np.zeros(len(raw), bool)
        if not a.whitened:  # a masked (cut) response trains on nothing
            return self._compare("advantage", advantage, np.where(cut, 0.0, raw), ELEMENTWISE(np.abs(raw)))
        stats, note = self._whitening_stats_to_use()
        if stats is None:
            if a.truncation == "mask" and (~cut).sum() < 2:  # fewer than two tokens outside the masked responses: no statistics, every advantage 0
                return self._compare("advantage", advantage, np.zeros(len(raw)), ELEMENTWISE(np.zeros(len(raw))), note)
            return Finding("skipped", note=note)
        from verl_ext.kernels import WHITEN_EPS  # verl's constant, written once (kernels loads torch: here, not at import)

        mean, var = stats
        sigma = math.sqrt(var + WHITEN_EPS)
        expected = (raw - mean) / sigma
        operands = np.abs(raw) + abs(mean)
        for name in ("return", "value"):  # a raw advantage rebuilt as returns − values carries their rounding
            if self.col[name] is not None:  # (a non-finite one is identity 8.5's finding, not this one's)
                operands = operands + np.where(np.isfinite(self.col[name]), np.abs(self.col[name]), 0.0)
        expected = np.where(cut, 0.0, expected)
        return self._compare("advantage", advantage, expected, WHITENING(expected, operands / sigma), note)

    @functools.cached_property
    def _raw_moments(self) -> tuple[float, float]:
        """μ, σ² of the step's raw advantages over the whitened tokens, computed here from the trace
        (independently of the statistics the capture recorded, which one identity compares them with)."""
        return _whitening_stats(self._whitened_raw())

    def _whitened_raw(self) -> np.ndarray:
        """The raw advantages the whitening statistics are over."""
        raw, kept = self.col["advantage_raw"], self._whitened_tokens()
        return raw if kept is None else raw[kept]

    def _kept_part(self) -> tuple[int, int] | None:
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
        kept = self._kept_part()
        if kept is not None:
            recorded = self._recorded_stats()
            if recorded is None:
                return None, f"traced {kept[0]} of {kept[1]} samples and no batch statistics recorded"
            return recorded, f"traced {kept[0]} of {kept[1]} samples: checked with the recorded batch μ, σ²"
        if len(self._whitened_raw()) < 2:
            return None, "fewer than two valid tokens: whitening is undefined" + self._outside_the_whitening()
        return self._raw_moments, None

    def _outside_the_whitening(self) -> str:
        """What a masked run leaves out of the statistics, for a note about them."""
        return " (the cut responses are outside it: truncation=mask)" if self.algorithm.truncation == "mask" else ""

    def whitening_stats(self) -> Finding:
        if self.algorithm.whitened is None:
            return self._without_estimator()
        if not self.algorithm.whitened:
            return skipped("whitening is off")
        if self.algorithm.truncation == "mask" and self.cut_problem is not None:
            return unchecked(self.cut_problem)
        recorded = self._recorded_stats()
        if recorded is None:
            return Finding("skipped", note="no whitening statistics recorded" + self._outside_the_whitening())
        kept = self._kept_part()
        if kept is not None:
            note = f"traced {kept[0]} of {kept[1]} samples: the full batch's statistics cannot be recomputed"
            return Finding("skipped", note=note)
        if (missing := self._missing(("advantage_raw",))) is not None:
            return missing
        if len(self._whitened_raw()) < 2:
            return Finding("skipped", note="fewer than two valid tokens" + self._outside_the_whitening())
        mean, var = self._raw_moments
        actual = [recorded[0], math.sqrt(max(recorded[1], 0.0))]
        expected = [mean, math.sqrt(var)]
        names = ("whiten.mean", "whiten.σ")
        return compare(actual, expected, STATISTICS(mean, math.sqrt(var)), lambda i: (Location(self.step), names[i]))

    def returns(self) -> Finding:
        a = self.algorithm
        if not a.recomputable:
            return self._without_estimator()
        if (missing := self._missing(("return", *self._inputs()))) is not None:
            return missing
        if self._returns_need_cuts():
            return unchecked(self.cut_problem)
        r = self.recomputed
        return self._compare("return", self.col["return"], r.returns, r.returns_tolerance)

    def bootstrap_value(self) -> Finding:
        """truncation=bootstrap: V(s_L) is recorded, finite, on exactly the cut responses."""
        cuts = self.cuts
        if cuts is None or cuts.cut is None:
            return self._no_cut_flags()
        layout = self.data.layout
        values = np.full(layout.samples, np.nan) if cuts.bootstrap_value is None else cuts.bootstrap_value
        lacking = cuts.cut & ~np.isfinite(values)  # null reads as NaN: either way no V(s_L) to bootstrap from
        extra = ~cuts.cut & ~np.isnan(values)
        wrong = np.flatnonzero(lacking | extra)
        first = None
        if len(wrong):
            i = int(wrong[0])
            detail = (
                "a cut response without a finite bootstrap_value: its returns cannot be recomputed"
                if lacking[i]
                else "bootstrap_value on a response that was not cut (one that ended bootstraps from 0)"
            )
            actual = None if np.isnan(values[i]) else float(values[i])
            first = Violation(Location(self.step, int(layout.sample_ids[i])), "bootstrap_value", actual, detail=f"{detail} ({TRUNCATION_SECTION})")
        return Finding("fail" if len(wrong) else "pass", checked=layout.samples, violations=len(wrong), first=first)

    def stop_reason(self) -> Finding:
        """Where the rollout engine said why it ended a response: a response it stopped at the length
        limit is ``truncated``; a single-turn response is ``truncated`` only there. A multi-turn response's
        stop reason is its last generation's, and an agent loop cuts a response that outgrows the length
        limit itself (verl's tool agent loop: its last turn ended, the response did not fit), so there a
        cut with another stop reason is the loop's."""
        cuts = self.cuts
        if cuts is None or cuts.stop_reason is None:
            return Finding("skipped", note="no stop reason from the rollout engine (verl's vLLM rollout gives one)")
        if cuts.cut is None:
            return self._no_cut_flags()
        layout = self.data.layout
        said = np.array([reason is not None for reason in cuts.stop_reason])
        at_length = np.array([reason == STOPPED_AT_LENGTH for reason in cuts.stop_reason])
        turns = np.zeros(layout.samples, np.int64)
        np.maximum.at(turns, layout.row_sample, layout.row_turns())  # each response's last turn (0: one turn)
        single = turns == 0
        wrong = np.flatnonzero(said & ((at_length & ~cuts.cut) | (cuts.cut & ~at_length & single)))
        first = None
        if len(wrong):
            i = int(wrong[0])
            detail = f"the engine's stop reason is {cuts.stop_reason[i]!r} ({TRUNCATION_SECTION})"
            first = Violation(Location(self.step, int(layout.sample_ids[i])), "truncated", float(cuts.cut[i]), detail=detail)
        note = f"{int(at_length.sum())} of {int(said.sum())} responses stopped by the engine at the length limit"
        if loop_cut := int((said & cuts.cut & ~at_length & ~single).sum()):
            note += f"; {loop_cut} multi-turn cut by the agent loop after a generation that ended"
        return Finding("fail" if len(wrong) else "pass", checked=int(said.sum()), violations=len(wrong), first=first, note=note)

    def cut_advantage(self) -> Finding:
        """truncation=mask: every valid token of a cut response has advantage 0."""
        cuts = self.cuts
        if cuts is None or cuts.cut is None:
            return self._no_cut_flags()
        if (missing := self._missing(("advantage",))) is not None:
            return missing
        cut, advantage = self._cut_tokens(), self.col["advantage"]
        wrong = np.flatnonzero(cut & (advantage != 0))  # NaN is wrong too
        first = None
        if len(wrong):
            sample, token = self.data.location(int(wrong[0]))
            detail = f"a cut response trains on nothing under truncation=mask ({TRUNCATION_SECTION})"
            first = Violation(Location(self.step, sample, token), "advantage", float(advantage[wrong[0]]), detail=detail)
        return Finding("fail" if len(wrong) else "pass", checked=int(cut.sum()), violations=len(wrong), first=first)

    def _no_cut_flags(self) -> Finding:
        """A run that treats cut responses apart, whose trace does not say which they are."""
        detail = f"null on every response: the trace does not say which responses were cut ({TRUNCATION_SECTION})"
        return Finding("fail", violations=1, first=Violation(Location(self.step), "truncated", detail=detail), note=detail)

    def rewards(self) -> Finding:
        if (missing := self._missing(("reward", "score"))) is not None:
            return missing
        reward = self.col["reward"]
        turn_rewards = [self.col[name] for name in TURN_REWARDS if self.col[name] is not None]
        score = self.col["score"] + sum(turn_rewards)  # the scores and what was added on turn ends
        magnitude = np.abs(self.col["score"]) + sum(np.abs(x) for x in turn_rewards)
        if not self.algorithm.kl_in_reward:
            return self._compare("reward", reward, score, ELEMENTWISE(magnitude))
        beta = step_beta(self.step_record)
        if beta is None:
            detail = "KL is in the reward but the run record has no β (kl_coef) for this step"
            return Finding("fail", violations=1, first=Violation(Location(self.step), "kl_coef", detail=detail), note=detail)
        if (missing := self._missing(("kl",))) is not None:
            return missing
        penalty = beta * self.col["kl"]
        tolerance = ELEMENTWISE(magnitude + np.abs(penalty))
        note = f"β = {beta:g}"
        if kl_dtype := self._held_in("kl"):  # verl multiplies β into the kl tensor in its dtype: one rounding there
            tolerance = tolerance + DTYPE_EPS.get(kl_dtype, EPS32) / 2 * np.abs(penalty)
            note += f"; kl held in {kl_dtype} by the trainer, so β·kl is rounded in {kl_dtype}: + ε/2·|β·kl|"
        return self._compare("reward", reward, score - penalty, tolerance, note=note)

    def turn_rewards(self) -> Finding:
        present = [name for name in TURN_REWARDS if self.col[name] is not None]
        if not present:
            return Finding("skipped", note=f"no per-turn rewards (verl_ext.turn_rewards off, or a trace before format {since(TURN_REWARDS[0])})")
        starts = self.data.layout.turn_starts
        ends = np.append(starts[1:], True)  # the next valid token starts a turn, or the sample is over
        checked, wrong_tokens, first = 0, 0, None
        for name in present:
            wrong = np.flatnonzero(~ends & (self.col[name] != 0))
            checked += len(ends)
            wrong_tokens += len(wrong)
            if len(wrong) and first is None:
                sample, token = self.data.location(int(wrong[0]))
                first = Violation(Location(self.step, sample, token), name, float(self.col[name][wrong[0]]), 0.0)
        return Finding("fail" if wrong_tokens else "pass", checked=checked, violations=wrong_tokens, first=first)

    def mask_layout(self) -> Finding:
        """The rows are the trace format's layout, and as many as the run record's entry of the step says."""
        problems = list(self.data.layout.problems())
        first = None
        if problems:
            row, message, _ = min(problems)
            sample, token = self.data.row_location(row)
            first = Violation(Location(self.step, sample, token), "mask", detail=message)
        violations = sum(count for _, _, count in problems)
        rows, listed = len(self.data.layout.mask), getattr(self.step_record, "rows", None)
        if isinstance(listed, int) and listed != rows:
            violations += 1
            first = first or Violation(Location(self.step), "rows", float(rows), float(listed), detail="the run record's rows of the step")
        return Finding("fail" if violations else "pass", checked=rows + 1, violations=violations, first=first)

    def turns(self) -> Finding:
        column = self.data.table.column("turn")
        if column.null_count == len(column):
            return Finding("skipped", note=f"no turn column (a trace written before format {since('turn')})")
        stored = floats(column)
        expected = self.data.layout.row_turns()
        wrong = np.flatnonzero(stored != expected)  # a null (NaN) is wrong too
        first = None
        if len(wrong):
            row = int(wrong[0])
            sample, token = self.data.row_location(row)
            first = Violation(Location(self.step, sample, token), "turn", float(stored[row]), float(expected[row]))
        return Finding("fail" if len(wrong) else "pass", checked=len(stored), violations=len(wrong), first=first)

    def roles(self) -> Finding:
        column = self.data.table.column("role")
        if column.null_count == len(column):
            return Finding("skipped", note=f"no role column (a trace written before format {since('role')})")
        # compared in Arrow: a Python string per row cost about a sixth of the step's check
        assistant = pc.equal(column, ROLE_ASSISTANT).fill_null(False).to_numpy()
        wrong = np.flatnonzero(assistant != self.data.layout.own)  # a null role on the policy's token is wrong too
        first = None
        if len(wrong):
            row = int(wrong[0])
            sample, token = self.data.row_location(row)
            due = "assistant (the policy's token)" if self.data.layout.own[row] else "not assistant (a hole)"
            first = Violation(Location(self.step, sample, token), "role", detail=f"role {column[row].as_py()!r}, expected {due}")
        return Finding("fail" if len(wrong) else "pass", checked=len(column), violations=len(wrong), first=first)

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
        for name, bad in self.data.nonfinite(names).items():
            violations += len(bad)
            if len(bad) and (first_row is None or bad[0] < first_row):
                first_row = int(bad[0])
                sample, token = self.data.location(first_row)
                detail = "null" if self.data.is_null(name, first_row) else "not finite"
                first = Violation(Location(self.step, sample, token), name, float(self.col[name][first_row]), detail=detail)
        checked = sum(len(self.col[n]) for n in names if self.col[n] is not None)
        return Finding("fail" if violations else "pass", checked=checked, violations=violations, first=first)


def _whitening_stats(x: np.ndarray) -> tuple[float, float]:
    """verl's masked_whiten statistics with verl's integer response mask: μ = Σx/n, σ² = Σ(x−μ)²/(n−1)
    (the 1e-8 verl adds to the means' count vanishes there: :data:`verl_ext.kernels.WHITEN_EPS`)."""
    n = len(x)
    mean = float(x.sum() / n)
    var = float(np.square(x - mean).sum() / (n - 1))
    return mean, var


@dataclass(frozen=True)
class RunScope:
    """What the RUN identities read: the trace and which of its steps are checked."""

    trace: Any
    selected: tuple[int, ...]
    everything: bool
    #: step -> why a file of it does not read (the check could not read the step)
    unreadable: dict[int, Any] = field(default_factory=dict)


MISSING_ON_DISK = "listed in the run record, missing on disk"


def steps_on_disk(run: RunScope) -> Iterator[tuple[int, Finding]]:
    """The run record's index against the files: a step or update table it lists must be on disk.
    (A step on disk that the record lacks is fine: the writer publishes data before the index.) And
    every checked step's files must read: one that does not (cut short, moved, another write's) fails
    here, naming the file, whether or not the record lists it."""
    trace = run.trace
    recorded = {int(step): entry for step, entry in trace.record.steps.items()}
    listed = set(recorded if run.everything else set(recorded) & set(run.selected))
    for step in sorted(listed | set(run.unreadable)):
        problems: list[tuple[str, str]] = []  # (file, what is wrong with it)
        if step in recorded:
            if step not in trace.steps:
                problems.append((recorded[step].file, MISSING_ON_DISK))
            problems += [(u.file, MISSING_ON_DISK) for kind, u in recorded[step].updates.items() if step not in trace.update_steps.get(kind, [])]
        if step in run.unreadable:
            error = run.unreadable[step]
            problems.append((error.file, _without_path(str(error), trace.path, error.file)))
        first = Violation(Location(step), problems[0][0], detail=problems[0][1]) if problems else None
        yield step, Finding("fail" if problems else "pass", checked=1, violations=len(problems), first=first)


def _without_path(message: str, trace_path: str, file: str) -> str:
    """The reader's message without the file's path it starts with (the violation names the file)."""
    for prefix in (f"{trace_path}/{file} ", f"{trace_path}: "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message

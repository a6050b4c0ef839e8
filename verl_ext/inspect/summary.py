"""One line of statistics per traced step, over valid tokens.

* ``samples``, ``tokens``: samples with at least one valid token, and their valid tokens
* ``score``, ``reward``: mean over samples of the sample's summed token scores / rewards
* ``kl``: mean kld_t per valid token (null when KL is not in the reward)
* ``value``, ``return``: means per valid token
* ``adv_raw_mean``, ``adv_raw_std``, ``adv_mean``, ``adv_std``: raw and trained-on advantage
  (std with n − 1, like masked_whiten, so a fully traced whitened step shows 1)
* ``explained_var``: 1 − Var(returns − values) / Var(returns), verl's ``critic/vf_explained_var``
* ``clip_low``, ``clip_high``, ``clip_dual``: fractions of the actor update's rows (all epochs)
  clipped low (A < 0), high (A > 0) and by the dual clip (null without update tables)
* ``adv_dlogp_corr``: correlation of the advantage with log_prob − old_log_prob in the last epoch:
  positive when the update raised the probability of the tokens it was told to raise
* ``ev_mc``, ``ev_mc_last``: 1 − Var(G − V)/Var(G) against the Monte-Carlo return G_t = Σ_{k≥t} γ^{k−t} r_k
  recomputed from the rewards (the same yardstick whatever the estimator), over all valid tokens and
  over each response's last valid token (null without values, or on fewer than 8 tokens: 8 responses
  for ``ev_mc_last``, docs/definitions.md §9); by position in
  :mod:`verl_ext.inspect.critic` (``verl-ext summary --critic``)
* ``turns``, ``adv_share_after_hole``, on a step with multi-turn responses only (docs/definitions.md
  §7): the mean number of assistant turns of the samples, and the share of the step's Σ|A| (raw
  advantage) on the tokens after a hole (turns k ≥ 1); null on a single-turn step
* ``tool_calls``: the mean number of tool messages merged into a response, over the samples whose
  agent loop said (the prompt table's ``tool_calls``, format 5); null when none did
* ``lp_gap_p50``, ``lp_gap_p99``, ``lp_gap_max``, ``offpolicy_kl``: how far the rollout engine and the
  trainer disagree, |log π_old − log π_rollout| and KL(π_rollout ‖ π_old) over the policy's tokens;
  ``is_mean``, ``is_ess``, ``is_truncated``: verl's importance weights (mean, effective sample size, the
  share the threshold changed); ``rejected_tokens``, ``rejected_responses``: what verl's rejection took
  out (docs/definitions.md#off-policy-tokens; :mod:`verl_ext.offpolicy_metrics`); null where the run has
  no rollout log-probs, weights or rejection. :func:`offpolicy_notes` names the steps past verl's own
  warning levels
* in a trace of verl's asynchronous trainers only (docs/definitions.md#policy-versions; the columns are
  not there otherwise): ``global_step``, ``substep``, ``trainer_version``, the step's place in verl's loop
  (verl's own step, which of its updates the trace step is, the policy version the update starts from);
  ``staleness_mean``, ``staleness_max`` of each response's staleness trainer_version − policy_version_min,
  ``stale_share`` the responses with a staleness above 0, ``spanned_share`` those whose generation spanned
  a weight update (:func:`verl_ext.offpolicy_metrics.staleness_metrics`, over the responses whose version
  is known); by staleness level: :func:`verl_ext.inspect.offpolicy.by_staleness`
* ``truncated_share``, ``adv_truncated``, ``adv_rest`` (docs/definitions.md#truncated-responses): the
  share of the samples (with a valid token) cut at the length limit (the prompt table's ``truncated``),
  and the mean advantage the actor trained on (whitened as recorded) over the valid tokens of the cut
  responses and of the others; all three null when the trace records no ``truncated`` flags
  (:func:`blank_notes` says so), ``adv_truncated`` (``adv_rest``) null on a step without a cut (uncut) response
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

import numpy as np
import pyarrow as pa

from verl_ext import offpolicy_metrics as off
from verl_ext.check.update_checks import update_statistics, why_no_correlation
from verl_ext.inspect import offpolicy
from verl_ext.inspect.critic import explained_variance, responses
from verl_ext.inspect.unread import UnreadSteps, readable
from verl_ext.step_metrics import critic_by_position, turn_shares
from verl_ext.steps.as_run import monte_carlo_returns
from verl_ext.steps.cuts import SECTION, StepCuts
from verl_ext.steps.layout import Progress, StepData, as_trace
from verl_ext.steps.recorded import RecordedAlgorithm
from verl_ext.steps.update_rows import UpdateRows
from verl_ext.steps.versions import StepPlace, StepVersions, may_be_asynchronous
from verl_ext.trace.parallel import map_steps

#: summary column -> the off-policy number it shows (verl_ext.offpolicy_metrics)
OFFPOLICY_COLUMNS = {
    "lp_gap_p50": off.GAP_P50, "lp_gap_p99": off.GAP_P99, "lp_gap_max": off.GAP_MAX, "offpolicy_kl": off.KL,
    "is_mean": off.IS_MEAN, "is_ess": off.IS_ESS, "is_truncated": off.IS_TRUNCATED,
    "rejected_tokens": off.REJECTED_TOKENS, "rejected_responses": off.REJECTED_RESPONSES,
}  # fmt: skip
SUMMARY_SCHEMA = pa.schema(
    [("step", pa.int64()), ("samples", pa.int64()), ("tokens", pa.int64())]
    + [
        (name, pa.float64())
        for name in (
            "score",
            "reward",
            "kl",
            "value",
            "return",
            "adv_raw_mean",
            "adv_raw_std",
            "adv_mean",
            "adv_std",
            "explained_var",
            "clip_low",
            "clip_high",
            "clip_dual",
            "adv_dlogp_corr",
            "ev_mc",
            "ev_mc_last",
            "turns",
            "adv_share_after_hole",
            "tool_calls",
            "truncated_share",
            "adv_truncated",
            "adv_rest",
            *OFFPOLICY_COLUMNS,
        )
    ]
)
#: summary column -> the staleness number it shows (verl_ext.offpolicy_metrics.staleness_metrics)
STALENESS_COLUMNS = {
    "staleness_mean": off.STALENESS_MEAN, "staleness_max": off.STALENESS_MAX, "stale_share": off.STALE_SHARE,
    "spanned_share": off.SPANNED_SHARE,
}  # fmt: skip
#: The columns a trace of an asynchronous run adds (after SUMMARY_SCHEMA's).
STALENESS_SCHEMA = pa.schema(
    [("global_step", pa.int64()), ("substep", pa.int64()), ("trainer_version", pa.int64()), ("staleness_mean", pa.float64()),
     ("staleness_max", pa.int64()), ("stale_share", pa.float64()), ("spanned_share", pa.float64())]
)  # fmt: skip
_COLUMNS = ("score", "reward", "kl", "value", "return", "advantage_raw", "advantage", *offpolicy.COLUMNS)


def summarize(
    trace,
    steps: Iterable[int] | None = None,
    progress: Progress | None = None,
    unread: UnreadSteps | None = None,
    *,
    jobs: int = 1,
    ray_address: str | None = None,
) -> pa.Table:
    """SUMMARY_SCHEMA (and STALENESS_SCHEMA's columns where a step is of an asynchronous run), one row per
    step (all traced steps, or ``steps``), read one step at a time, in
    ``jobs`` processes or as Ray tasks (:func:`verl_ext.trace.parallel.map_steps`: the same rows).
    ``unread``: where to note a step whose files do not read, which is then left out (without it, such
    a step raises :class:`~verl_ext.errors.StepFileError`)."""
    trace = as_trace(trace)
    selected = list(trace.steps if steps is None else steps)
    outcomes = map_steps(trace, selected, summary_row, jobs=jobs, ray_address=ray_address, progress=progress)
    rows = [row for _, row in readable(outcomes, unread)]
    asynchronous = any(row.get("global_step") is not None for row in rows)
    schema = pa.schema([*SUMMARY_SCHEMA, *STALENESS_SCHEMA]) if asynchronous else SUMMARY_SCHEMA
    return pa.Table.from_pylist(rows, schema=schema)


def summary_row(trace, step: int) -> tuple[dict, int]:
    """One step's row of :func:`summarize` and its valid tokens."""
    algorithm = RecordedAlgorithm.from_record(trace.record)
    data = StepData.read(trace, step, _COLUMNS)
    prompts = trace.prompts(step)
    row = step_summary(data, algorithm.gamma) | update_statistics(trace, step) | tool_statistics(prompts) | truncation_statistics(prompts, data)
    numbers = offpolicy.step_offpolicy(data, algorithm.correction)
    row |= {column: numbers.get(name) for column, name in OFFPOLICY_COLUMNS.items()}
    if may_be_asynchronous(trace.record):
        row |= staleness_statistics(StepVersions.of(StepPlace.of(trace, step), prompts))
    return row, data.tokens


def staleness_statistics(versions: StepVersions) -> dict:
    """STALENESS_SCHEMA's columns of a step (module docstring); {} for a step of a synchronous run."""
    place = versions.place
    if not place.asynchronous:
        return {}
    numbers = versions.metrics()
    row = {column: numbers.get(name) for column, name in STALENESS_COLUMNS.items()}
    if row["staleness_max"] is not None:
        row["staleness_max"] = int(row["staleness_max"])
    return row | {"global_step": place.verl_step, "substep": place.substep, "trainer_version": place.trainer_version}


def offpolicy_notes(summary: pa.Table) -> list[str]:
    """One line per step whose off-policy numbers cross the warning levels of verl's
    docs/algo/rollout_corr.md (mean IS weight outside [0.5, 2], effective sample size < 0.3, |KL| > 0.1)."""
    lines = []
    for row in summary.to_pylist():
        numbers = {name: row[column] for column, name in OFFPOLICY_COLUMNS.items() if row[column] is not None}
        if crossed := off.warnings(numbers):
            lines.append(f"step {row['step']}: {'; '.join(crossed)}: past verl's warning level (its docs/algo/rollout_corr.md)")
    return lines


def blank_notes(trace, summary: pa.Table) -> list[str]:
    """One line per reason a column of ``summary`` (:func:`summarize`'s) is blank where a reader
    would look for a number: ``adv_dlogp_corr`` on a step of a trace with update tables (say, step 1
    of a run whose learning rate warms up from 0), the cut responses' columns on a step without flags."""
    trace = as_trace(trace)
    return _correlation_notes(trace, summary) + _truncation_notes(summary) + _staleness_notes(summary)


def _staleness_notes(summary: pa.Table) -> list[str]:
    """Where a step of an asynchronous run has no staleness, why (a synchronous run's summary has no such column)."""
    if "staleness_mean" not in summary.column_names:
        return []
    rows = summary.select(["step", "trainer_version", "staleness_mean"]).to_pylist()
    no_version = [row["step"] for row in rows if row["staleness_mean"] is None and row["trainer_version"] is None]
    no_response = [row["step"] for row in rows if row["staleness_mean"] is None and row["trainer_version"] is not None]
    lines = []
    if no_version:
        lines.append(f"staleness is blank at {_steps_text(no_version)}: the trace does not say which policy version the update started from")
    if no_response:
        lines.append(f"staleness is blank at {_steps_text(no_response)}: no response's policy version is recorded (the rollout did not say)")
    return lines


def _truncation_notes(summary: pa.Table) -> list[str]:
    blank = [row["step"] for row in summary.select(["step", "truncated_share"]).to_pylist() if row["truncated_share"] is None]
    if not blank:
        return []
    return [
        f"truncated_share, adv_truncated and adv_rest are blank at {_steps_text(blank)}: the trace records no "
        f"truncated flags (a trace of format 1, or of a run whose EOS tokens or max_response_length it did not know; {SECTION})"
    ]


def _correlation_notes(trace, summary: pa.Table) -> list[str]:
    blank = [row["step"] for row in summary.select(["step", "adv_dlogp_corr"]).to_pylist() if row["adv_dlogp_corr"] is None]
    if not blank:
        return []
    if not trace.update_steps.get("actor"):
        return []  # no update tables: the update's columns are blank on every step, and text leaves them out
    steps_by_reason: dict[str, list[int]] = {}
    for step in blank:
        steps_by_reason.setdefault(why_no_correlation(trace, step), []).append(step)
    return [f"adv_dlogp_corr is blank at {_steps_text(steps)}: {reason}" for reason, steps in steps_by_reason.items()]


def _steps_text(steps: list[int]) -> str:
    shown = ", ".join(map(str, steps[:6])) + (f", … ({len(steps)} steps)" if len(steps) > 6 else "")
    return f"step{'s' if len(steps) > 1 else ''} {shown}"


def step_summary(data: StepData, gamma: float) -> dict:
    """The statistics of one step (every column but the update's), ``gamma`` the run's γ."""
    col = data.columns
    layout = data.layout
    sampled = np.flatnonzero(layout.valid_counts)  # samples with at least one valid token

    def sample_mean(values: np.ndarray | None) -> float | None:
        if values is None or not len(sampled):
            return None
        return float(layout.sample_sums(values)[sampled].mean())

    def mean(values: np.ndarray | None) -> float | None:
        return float(values.mean()) if values is not None and len(values) else None

    def std(values: np.ndarray | None) -> float | None:
        return float(values.std(ddof=1)) if values is not None and len(values) > 1 else None

    return {
        "step": data.step,
        "samples": layout.samples,
        "tokens": data.tokens,
        "score": sample_mean(col["score"]),
        "reward": sample_mean(col["reward"]),
        "kl": mean(col["kl"]),
        "value": mean(col["value"]),
        "return": mean(col["return"]),
        "adv_raw_mean": mean(col["advantage_raw"]),
        "adv_raw_std": std(col["advantage_raw"]),
        "adv_mean": mean(col["advantage"]),
        "adv_std": std(col["advantage"]),
        "explained_var": explained_variance(col["value"], col["return"]),
        **monte_carlo_explained_variance(data, gamma),
        **turn_statistics(data),
    }


def turn_statistics(data: StepData) -> dict:
    """``turns`` and ``adv_share_after_hole`` (module docstring); null on a single-turn step."""
    step_responses = responses(data.layout)
    if not step_responses.multi_turn:
        return {"turns": None, "adv_share_after_hole": None}
    turns = step_responses.turns[step_responses.lengths > 0]
    raw = data.columns["advantage_raw"] if data.columns["advantage_raw"] is not None else data.columns["advantage"]
    shares = {} if raw is None else turn_shares(raw, step_responses)
    return {"turns": float(turns.mean()), "adv_share_after_hole": (1.0 - shares["turn0"]) if shares else None}


def tool_statistics(prompts: pa.Table) -> dict:
    """``tool_calls`` (module docstring), from a step's prompt table."""
    counts = prompts.column("tool_calls").drop_null().to_numpy()
    return {"tool_calls": float(counts.mean()) if len(counts) else None}


def truncation_statistics(prompts: pa.Table, data: StepData) -> dict:
    """``truncated_share``, ``adv_truncated`` and ``adv_rest`` (module docstring), from a step's prompt table."""
    cuts = StepCuts.of(prompts, data.layout)
    blank = {"truncated_share": None, "adv_truncated": None, "adv_rest": None}
    if not cuts.recorded:
        return blank
    sampled = data.layout.valid_counts > 0
    share = float(cuts.cut[sampled].mean()) if sampled.any() else None
    advantages = data.columns["advantage"]
    if advantages is None:
        return blank | {"truncated_share": share}
    on_cut = cuts.at_tokens(data.layout)

    def mean(values: np.ndarray) -> float | None:
        return float(values.mean()) if len(values) else None

    return {"truncated_share": share, "adv_truncated": mean(advantages[on_cut]), "adv_rest": mean(advantages[~on_cut])}


def monte_carlo_explained_variance(data: StepData, gamma: float) -> dict:
    """``ev_mc`` and ``ev_mc_last``: the explained variance of the values against the Monte-Carlo
    return, over all valid tokens and over the last valid token of each response."""
    values = data.columns["value"]
    if values is None or data.columns["reward"] is None:
        return {"ev_mc": None, "ev_mc_last": None}
    by_position = critic_by_position(values, monte_carlo_returns(data, gamma), responses(data.layout))
    return {"ev_mc": by_position["all"]["explained_var"], "ev_mc_last": by_position["last"]["explained_var"]}


def sample_flags(data: StepData, updates: Iterable[UpdateRows] = ()) -> dict[str, np.ndarray | None]:
    """Per sample of ``data``'s layout, in its order: ``score``, its tokens' scores summed (None
    without a ``score`` column in ``data``); ``wrong``, a finite score below the step's best finite
    one; ``nonfinite``, a column of ``data`` null or not finite at one of its valid tokens, or a float
    of one of its rows in ``updates`` (the step's update tables); ``clipped``, PPO clipped one of its
    tokens in ``updates``."""
    layout = data.layout
    values = data.columns.get("score")
    score = None if values is None else layout.sample_sums(values)
    wrong = np.zeros(layout.samples, bool)
    if score is not None and np.isfinite(score).any():
        finite = np.isfinite(score)
        wrong = finite & (score < score[finite].max())
    nonfinite = layout.samples_among(np.concatenate([np.zeros(0, np.int64), *data.nonfinite(list(data.columns)).values()]))
    clipped = np.zeros(layout.samples, bool)
    for rows in updates:
        where = layout.index_of(rows.sample)
        known = where >= 0
        nonfinite[where[rows.nonfinite() & known]] = True
        clipped[where[rows.clipped() & known]] = True
    return {"score": score, "wrong": wrong, "nonfinite": nonfinite, "clipped": clipped}


def whitening(recorded: Mapping | None, summary_row: Mapping | None = None) -> dict[str, float | None] | None:
    """The μ and σ a step's advantages were whitened with, as {"mean", "sigma"}: the step record's
    whitening statistics (``recorded``: {"mean", "var"}); else, given the step's :func:`summarize`
    row, its raw advantage's mean and std; else None."""
    if not recorded or recorded.get("mean") is None or recorded.get("var") is None or recorded["var"] < 0:
        return None if summary_row is None else {"mean": summary_row.get("adv_raw_mean"), "sigma": summary_row.get("adv_raw_std")}
    return {"mean": recorded["mean"], "sigma": math.sqrt(recorded["var"])}

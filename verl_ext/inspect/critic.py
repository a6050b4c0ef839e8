"""Is the critic ready? Its values against the Monte-Carlo return, per step and by position.

On each response's compacted valid tokens t = 0 … L−1 (docs/definitions.md §9, "Is the critic
ready?"):

* G_t = Σ_{k=t}^{L−1} γ^{k−t} r_k, the Monte-Carlo return, recomputed from the recorded ``reward``
  with the run's γ by the registry's ``mc`` estimator: the same yardstick whatever estimator built
  the critic's targets (``return`` is the target only for ``mc``);
* V_t, the recorded ``value`` (the critic's prediction for the state before token t).

Buckets by position: the valid token of rank i (0-based) of a response with L valid tokens is in
the decile ``d{⌊10·i/L⌋}`` (``d0`` … ``d9``; a response shorter than 10 tokens leaves some empty);
``last`` holds each response's last valid token (i = L−1, which is also in its decile); ``all``
every valid token. On a multi-turn step (docs/definitions.md §7) also by turn: ``turn{k}`` holds the
first token of each response's assistant turn k, the state after its k-th hole (a tool's answer),
and ``after_hole`` those of every turn k ≥ 1. Per (step, bucket), over the bucket's n tokens of the step:

* ``explained_var`` = 1 − Var(G − V) / Var(G), variances with n − 1 as verl's
  ``critic/vf_explained_var``; null when n < MIN_EV_TOKENS (8: on fewer, it swings on a handful
  of returns) or Var(G) = 0 (:func:`verl_ext.step_metrics.enough_tokens`);
* ``mean_abs_error`` = mean |V − G|; ``mean_return`` = mean G; ``mean_value`` = mean V
  (null when n = 0).

EV ≈ 0 at the positions after the decision point means the critic cannot tell a good response from
a bad one there: it is blind, and every estimator that bootstraps from it is biased.
"""

from __future__ import annotations

from typing import Iterable

import pyarrow as pa

from verl_ext.errors import UsageError
from verl_ext.steps.as_run import monte_carlo_returns
from verl_ext.steps.layout import Progress, StepData, StepLayout, as_trace
from verl_ext.steps.recorded import RecordedAlgorithm
from verl_ext.inspect.render import render
from verl_ext.inspect.unread import UnreadSteps, readable
from verl_ext.trace.parallel import map_steps
from verl_ext.step_metrics import (
    BUCKETS,
    DECILES,
    MIN_EV_TOKENS,
    Responses,
    critic_by_position,
    critic_by_turn,
    explained_variance,
    step_metrics,
)

__all__ = [
    "BUCKETS", "DECILES", "MIN_EV_TOKENS", "critic_diagnostics", "critic_report", "explained_variance", "few_tokens_note",
    "step_diagnostics", "steps_by_bucket", "traced_step_metrics",
]  # fmt: skip

#: One row per (step, bucket), every bucket of BUCKETS of every step (a bucket without tokens has
#: nulls), and the turn buckets of a multi-turn step.
CRITIC_SCHEMA = pa.schema(
    [("step", pa.int64()), ("bucket", pa.string()), ("tokens", pa.int64())]
    + [(name, pa.float64()) for name in ("explained_var", "mean_abs_error", "mean_return", "mean_value")]
)
METRICS = tuple(CRITIC_SCHEMA.names[2:])


def critic_diagnostics(trace, steps: Iterable[int] | None = None, progress: Progress | None = None,
                       unread: UnreadSteps | None = None, *, jobs: int = 1, ray_address: str | None = None) -> pa.Table:  # fmt: skip
    """CRITIC_SCHEMA: for every step (all traced steps, or ``steps``) and every bucket of BUCKETS,
    the critic's values against the Monte-Carlo return (module docstring), one step read at a time, in
    ``jobs`` processes or as Ray tasks (:func:`verl_ext.trace.parallel.map_steps`: the same rows).
    ``unread``: where to note a step whose files do not read, which is then left out (without it,
    such a step raises :class:`~verl_ext.errors.StepFileError`).

    A step without values (a run without a critic, such as ``grpo``) is a UsageError."""
    trace = as_trace(trace)
    selected = [trace.require_step(step) for step in (trace.steps if steps is None else steps)]
    outcomes = map_steps(trace, selected, critic_rows, jobs=jobs, ray_address=ray_address, progress=progress)
    rows = [row for _, step_rows in readable(outcomes, unread) for row in step_rows]
    return pa.Table.from_pylist(rows, schema=CRITIC_SCHEMA)


def critic_rows(trace, step: int) -> tuple[list[dict], int]:
    """One step's rows of :func:`critic_diagnostics` and its valid tokens."""
    data = StepData.read(trace, step, ("reward", "value"))
    return _checked_diagnostics(trace, data, RecordedAlgorithm.from_record(trace.record).gamma), data.tokens


def _checked_diagnostics(trace, data: StepData, gamma: float) -> list[dict]:
    """:func:`step_diagnostics`, or a UsageError for a step without values or rewards."""
    if data.columns["value"] is None or data.columns["reward"] is None:
        missing = "values" if data.columns["value"] is None else "rewards"
        estimator = trace.record.algorithm.get("adv_estimator")
        raise UsageError(
            f"step {data.step} has no {missing}: nothing to compare the critic with "
            f"(adv_estimator={estimator}; a run without a critic, such as grpo, has no values)"
        )
    return step_diagnostics(data, gamma)


def step_diagnostics(data: StepData, gamma: float) -> list[dict]:
    """The CRITIC_SCHEMA rows of one step (``data`` with ``reward`` and ``value``), in BUCKETS order,
    then turn0, turn1, …, after_hole on a multi-turn step (computed by
    :func:`verl_ext.step_metrics.critic_by_position` and ``critic_by_turn``, as the live metrics are)."""
    values, returns, step_responses = data.columns["value"], monte_carlo_returns(data, gamma), responses(data.layout)
    by_bucket = critic_by_position(values, returns, step_responses)
    if step_responses.multi_turn:
        by_bucket |= critic_by_turn(values, returns, step_responses)
    return [{"step": data.step, "bucket": bucket, **stats} for bucket, stats in by_bucket.items()]


def traced_step_metrics(trace, step: int) -> dict[str, float]:
    """The live metrics of ``step`` (docs/definitions.md §9, names without ``verl_ext/``), computed
    after the fact from its trace by :func:`verl_ext.step_metrics.step_metrics`, the function the
    trainer ran on its batch: equal to what verl's logger got at that step, to float32 rounding,
    when the trace kept every response (``verl_ext.trace.max_samples_per_step`` unset).

    G is recomputed from the recorded rewards with the run's γ; the raw advantage is the recorded
    ``advantage_raw``, or the advantage where there is none (verl's estimators other than ``gae``,
    e.g. ``grpo``, whose normalization is their own); a response's score is the sum of its tokens'
    ``score``; the off-policy numbers are :func:`verl_ext.inspect.offpolicy.step_offpolicy`'s."""
    from verl_ext.inspect import offpolicy

    trace = as_trace(trace)
    trace.require_step(step)
    data = StepData.read(trace, step, ("reward", "value", "advantage_raw", "advantage", "score", *offpolicy.COLUMNS))
    layout, columns = data.layout, data.columns
    algorithm = RecordedAlgorithm.from_record(trace.record)
    returns = None
    if columns["value"] is not None and columns["reward"] is not None:
        returns = monte_carlo_returns(data, algorithm.gamma)
    scores = None
    if columns["score"] is not None:
        scores = layout.sample_sums(columns["score"])
    uid = trace.read_step(step, ["uid"]).column("uid").to_pylist()
    raw = columns["advantage_raw"] if columns["advantage_raw"] is not None else columns["advantage"]
    has_tokens = layout.valid_counts > 0
    return step_metrics(
        responses(layout),
        returns=returns,
        values=columns["value"],
        advantage_raw=raw,
        advantage=columns["advantage"],
        scores=None if scores is None else scores[has_tokens],
        uid=None if None in uid else [uid[row] for row in layout.starts[has_tokens]],
    ) | offpolicy.step_offpolicy(data, algorithm.correction)


def responses(layout: StepLayout) -> Responses:
    """The step's responses as :mod:`verl_ext.step_metrics` takes them: the valid tokens of each, and
    where each assistant turn starts."""
    return Responses.of(layout.valid_counts, layout.turn_starts)


def few_tokens_note(diagnostics: pa.Table) -> str | None:
    """What a reader of :func:`critic_diagnostics` should know when some bucket with tokens has its
    explained variance left blank for having fewer than MIN_EV_TOKENS; None when none has."""
    few = sum(1 for tokens in diagnostics.column("tokens").to_pylist() if 0 < tokens < MIN_EV_TOKENS)
    if not few:
        return None
    return (
        f"EV is blank where a bucket holds fewer than {MIN_EV_TOKENS} tokens ({few} step × bucket cell{'s' if few > 1 else ''} "
        "here): on a handful of returns it swings far below −1 and says nothing (docs/definitions.md §9)"
    )


def steps_by_bucket(diagnostics: pa.Table, metric: str = "explained_var") -> pa.Table:
    """The wide form of one metric of :func:`critic_diagnostics`: one row per step, columns
    ``step`` then one per bucket present (BUCKETS order, then the turns in order, then
    after_hole), null where the bucket has no value."""
    if metric not in METRICS:
        raise UsageError(f"unknown metric {metric!r}; expected one of {', '.join(METRICS)}")
    rows = diagnostics.select(["step", "bucket", metric]).to_pylist()
    steps = sorted({row["step"] for row in rows})
    present = {row["bucket"] for row in rows}
    turns = sorted((b for b in present if b.startswith("turn")), key=lambda b: int(b[4:]))
    buckets = [b for b in BUCKETS if b in present] + turns + [b for b in ("after_hole",) if b in present]
    cell = {(row["step"], row["bucket"]): row[metric] for row in rows}
    kind = CRITIC_SCHEMA.field(metric).type
    columns = {"step": pa.array(steps, pa.int64())}
    columns |= {bucket: pa.array([cell.get((step, bucket)) for step in steps], kind) for bucket in buckets}
    return pa.table(columns)


def critic_report(diagnostics: pa.Table, gamma: float, fmt: str = "text", digits: int = 4) -> str:
    """:func:`critic_diagnostics` (of a run with discount ``gamma``) as ``verl-ext summary --critic``
    prints it below the run's header, in ``fmt`` (``render``'s formats) with floats to ``digits``
    decimals. CSV: the long table as it is. Text and Markdown: a heading then a table, one row per
    step and one column per bucket (:func:`steps_by_bucket`), for the explained variance (then the
    :func:`few_tokens_note`, if any), the tokens and the mean |V − G|; blank lines between."""
    if fmt == "csv":
        return render(diagnostics, "csv")
    note = few_tokens_note(diagnostics)
    sections = [
        f"explained variance 1 − Var(G − V)/Var(G) of the values V against the Monte-Carlo return G (γ = {gamma:g}),\n"
        "by position: d0 … d9 the deciles of each response's valid tokens, last its last valid token, all every one:",
        render(steps_by_bucket(diagnostics, "explained_var"), fmt, digits),
        *([f"note: {note}"] if note else []),
        "tokens by position:",
        render(steps_by_bucket(diagnostics, "tokens"), fmt, digits),
        "mean |V − G| by position:",
        render(steps_by_bucket(diagnostics, "mean_abs_error"), fmt, digits),
    ]
    return "\n\n".join(sections)

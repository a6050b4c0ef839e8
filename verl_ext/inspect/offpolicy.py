"""A traced step's off-policy numbers (docs/definitions.md#off-policy-tokens): how far the rollout
engine and the trainer disagree on the policy's own tokens, and what verl's rollout correction did,
by :func:`verl_ext.offpolicy_metrics.offpolicy_metrics` (the function the live metrics run on the
trainer's batch), for ``summary``, its notes and the live metrics recomputed from a trace; and by
position (:func:`by_decile`, ``verl-ext plot``'s off-policy figure). And, in a trace of verl's
asynchronous trainers, the update and those numbers by staleness (:func:`by_staleness`:
``verl-ext summary --by-staleness``, ``verl-ext plot``'s staleness figure)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from verl_ext.offpolicy_metrics import offpolicy_metrics
from verl_ext.step_metrics import DECILES, Responses
from verl_ext.steps.layout import StepData, floats

#: The token columns the numbers read (``rejected`` comes with the layout).
COLUMNS = ("old_log_prob", "rollout_log_prob", "rollout_is_weight")


def step_offpolicy(data: StepData, correction=None) -> dict[str, float]:
    """``offpolicy/…`` -> value for ``data`` (read with :data:`COLUMNS`); ``correction``: the run's
    (:class:`verl_ext.rollout_correction.Correction`, whose upper bound the effective sample size
    clamps to), None without one. Empty without both log-probs."""
    old, rollout = data.at_own_tokens("old_log_prob"), data.at_own_tokens("rollout_log_prob")
    if old is None or rollout is None:
        return {}
    rejects = correction is not None and bool(correction.rejection) and not correction.bypass_mode
    rejected = data.at_own_tokens("rejected") if rejects else None
    return offpolicy_metrics(
        old, rollout, data.layout.own_counts, data.at_own_tokens("rollout_is_weight"),
        None if correction is None else correction.is_upper, None if rejected is None else rejected != 0,
    )  # fmt: skip


def by_decile(data: StepData, correction=None) -> dict[str, np.ndarray] | None:
    """Per decile d0 … d9 of each response's own tokens (valid or rejected; the token of rank i of a
    response with L of them is in decile ⌊10·i/L⌋, as the critic's diagnostics count valid tokens),
    arrays of 10 (NaN for a decile without a token): ``tokens``; ``gap_p50``, ``gap_p99``, ``gap_max`` of
    |ℓ_t| = |log π_old − log π_rollout| (the quantiles of :func:`~verl_ext.offpolicy_metrics.offpolicy_metrics`);
    ``rejected``, the share of the tokens verl's rejection took out, and ``is_mean``, the mean importance
    weight, each where the run has it (``correction``: as :func:`step_offpolicy`'s). None without both
    log-probs. ``data``: read with :data:`COLUMNS`."""
    old, rollout = data.at_own_tokens("old_log_prob"), data.at_own_tokens("rollout_log_prob")
    if old is None or rollout is None:
        return None
    decile = Responses.of(data.layout.own_counts).decile
    gap = np.abs(old - rollout)
    rows = [gap[decile == d] for d in range(len(DECILES))]
    out = {
        "tokens": np.array([len(r) for r in rows], float),
        "gap_p50": np.array([np.quantile(r, 0.5) if len(r) else np.nan for r in rows]),
        "gap_p99": np.array([np.quantile(r, 0.99) if len(r) else np.nan for r in rows]),
        "gap_max": np.array([r.max() if len(r) else np.nan for r in rows]),
    }
    rejects = correction is not None and bool(correction.rejection) and not correction.bypass_mode
    for key, name in (("rejected", "rejected" if rejects else None), ("is_mean", "rollout_is_weight")):
        values = None if name is None else data.at_own_tokens(name)
        if values is not None:
            out[key] = np.array([r.mean() if len(r) else np.nan for r in (values[decile == d] for d in range(len(DECILES)))])
    return out


# --------------------------------------------------------------------------- by staleness (asynchronous runs)

#: ``by_staleness``'s table: one row per (step, staleness level), then one per level over every step (step null).
BY_STALENESS_SCHEMA = pa.schema([
    ("step", pa.int64()), ("staleness", pa.int64()), ("responses", pa.int64()), ("tokens", pa.int64()), ("update_rows", pa.int64()),
    ("ratio_dev", pa.float64()), ("ratio_dev_max", pa.float64()), ("clip_frac", pa.float64()), ("is_mean", pa.float64()),
    ("lp_gap_mean", pa.float64()),
])  # fmt: skip
#: What each level of one step sums (pooled over steps by adding, but the maximum).
_SUMS = ("responses", "tokens", "update_rows", "ratio_dev_sum", "clipped", "weight_sum", "weights", "gap_sum", "gaps")


def staleness_sums(trace, step: int) -> tuple[dict[int, dict[str, float]], int]:
    """Per staleness level of ``step``'s responses (docs/definitions.md#policy-versions; the responses whose
    version is unknown left out), what :func:`by_staleness` averages: the responses, their own tokens
    (valid or rejected), the actor-update rows of their tokens (every epoch), Σ|ratio − 1| and its maximum,
    the rows clipped (any clip code but none), Σ of the importance weights and Σ|log π_old − log π_rollout|
    over their own tokens, with the counts of each. Empty where the step has no staleness (a synchronous run,
    no versions, no trainer version). With the step's valid tokens (``map_steps``' second value)."""
    from verl_ext.steps.versions import StepVersions

    versions = StepVersions.read(trace, step)
    if versions.staleness is None or not versions.known:
        return {}, 0
    data = StepData.read(trace, step, COLUMNS)
    layout = data.layout
    per_sample = versions.at(layout.sample_ids)["staleness"]
    own_level = np.repeat(per_sample, layout.own_counts)
    old, rollout, weights = (data.at_own_tokens(name) for name in COLUMNS)
    gap = None if old is None or rollout is None else np.abs(old - rollout)
    rows = None
    if step in trace.update_steps.get("actor", []):
        rows = trace.actor_update(step, columns=["sample", "ratio", "clip"])
        at = layout.index_of(rows["sample"].to_numpy())
        row_level = np.where(at >= 0, per_sample[np.maximum(at, 0)], np.nan)
        deviation = np.abs(floats(rows["ratio"]) - 1.0)
        clipped = rows["clip"].to_numpy(zero_copy_only=False) != "none"
    levels: dict[int, dict[str, float]] = {}
    for level in np.unique(per_sample[np.isfinite(per_sample)]):
        here = own_level == level
        sums = {"responses": int(np.sum(per_sample == level)), "tokens": int(here.sum())}
        sums |= {"weight_sum": float(weights[here].sum()), "weights": int(here.sum())} if weights is not None else {"weights": 0}
        sums |= {"gap_sum": float(gap[here].sum()), "gaps": int(here.sum())} if gap is not None else {"gaps": 0}
        if rows is not None:
            trained = row_level == level
            sums |= {"update_rows": int(trained.sum()), "ratio_dev_sum": float(deviation[trained].sum()),
                     "ratio_dev_max": float(deviation[trained].max()) if trained.any() else None,
                     "clipped": int(clipped[trained].sum())}  # fmt: skip
        levels[int(level)] = sums
    return levels, data.tokens


def staleness_rows(step: int | None, levels: dict[int, dict[str, float]]) -> list[dict]:
    """:data:`BY_STALENESS_SCHEMA` rows of ``levels`` (:func:`staleness_sums`, or their pooled sums)."""
    out = []
    for level, sums in sorted(levels.items()):
        rows, weights, gaps = sums.get("update_rows"), sums.get("weights", 0), sums.get("gaps", 0)
        out.append({
            "step": step, "staleness": level, "responses": sums["responses"], "tokens": sums["tokens"], "update_rows": rows,
            "ratio_dev": sums["ratio_dev_sum"] / rows if rows else None, "ratio_dev_max": sums.get("ratio_dev_max") if rows else None,
            "clip_frac": sums["clipped"] / rows if rows else None,
            "is_mean": sums["weight_sum"] / weights if weights else None, "lp_gap_mean": sums["gap_sum"] / gaps if gaps else None,
        })  # fmt: skip
    return out


def pooled(per_step: list[dict[int, dict[str, float]]]) -> dict[int, dict[str, float]]:
    """The levels of several steps added up (their maximum |ratio − 1| the largest)."""
    out: dict[int, dict[str, float]] = {}
    for levels in per_step:
        for level, sums in levels.items():
            into = out.setdefault(level, {})
            for key, value in sums.items():
                if value is None:
                    into.setdefault(key, None)
                elif key == "ratio_dev_max":
                    into[key] = value if into.get(key) is None else max(into[key], value)
                else:
                    into[key] = (into.get(key) or 0) + value
    return out


def by_staleness(trace, steps=None, progress=None, unread=None, *, jobs: int = 1, ray_address: str | None = None) -> pa.Table:
    """The update and the off-policy numbers by staleness (docs/definitions.md#policy-versions): per step
    and staleness level s (the responses trained s weight updates after the policy that generated them),
    the responses, their own tokens, the actor-update rows of their tokens (every epoch), the mean and
    largest |ratio − 1| and the share clipped over those rows, the mean importance weight and mean |ℓ_t| =
    |log π_old − log π_rollout| over their own tokens (null where the run has none); then each level over
    every step (``step`` null). Empty where no step has staleness. Steps read as :func:`summarize` reads them
    (``steps``, ``progress``, ``unread``, ``jobs``, ``ray_address``)."""
    from verl_ext.inspect.unread import readable
    from verl_ext.steps.layout import as_trace
    from verl_ext.trace.parallel import map_steps

    trace = as_trace(trace)
    selected = list(trace.steps if steps is None else steps)
    outcomes = map_steps(trace, selected, staleness_sums, jobs=jobs, ray_address=ray_address, progress=progress)
    per_step = [(step, levels) for step, levels in readable(outcomes, unread) if levels]
    rows = [row for step, levels in per_step for row in staleness_rows(step, levels)]
    rows += staleness_rows(None, pooled([levels for _, levels in per_step])) if per_step else []
    return pa.Table.from_pylist(rows, schema=BY_STALENESS_SCHEMA)


def staleness_report(table: pa.Table, fmt: str = "text", digits: int = 4) -> str:
    """:func:`by_staleness`'s table as ``verl-ext summary --by-staleness`` prints it: CSV the table as it
    is (the rows over every step with ``step`` empty); text and Markdown a heading and the table per step,
    then the levels over every step."""
    from verl_ext.inspect.render import render

    if fmt == "csv":
        return render(table, "csv")
    is_pooled = table["step"].is_null()
    per_step, every = table.filter(pa.compute.invert(is_pooled)), table.filter(is_pooled).drop_columns(["step"])
    return "\n\n".join([
        "by staleness s = trainer_version − policy_version_min (the responses trained s weight updates after the policy "
        "that generated them): their own tokens, the actor-update rows of those tokens (every epoch) with the mean and "
        "largest |ratio − 1| and the share clipped, the mean importance weight and mean |log π_old − log π_rollout|; per step:",
        render(per_step, fmt, digits),
        "over every step:",
        render(every, fmt, digits),
    ])  # fmt: skip

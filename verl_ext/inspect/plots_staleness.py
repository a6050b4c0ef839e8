"""The staleness figure of ``verl-ext plot`` (``staleness.png``), for a trace of verl's asynchronous trainers
(docs/definitions.md#policy-versions): how stale each step's responses were, and what the update and the
rollout correction did by staleness. :mod:`verl_ext.inspect.plots` draws it with the run's other figures and
exports :func:`staleness_figure`; it is drawn only where some step has a staleness.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from verl_ext.errors import UsageError
from verl_ext.inspect import offpolicy
from verl_ext.inspect.summary import summarize
from verl_ext.steps.layout import as_trace

MEAN_COLOR, MAX_COLOR, SHARE_COLOR = "#1f77b4", "#d62728", "#8c8c8c"
DEV_COLOR, CLIP_COLOR, WEIGHT_COLOR, GAP_COLOR = "#2ca02c", "#8c8c8c", "#ff7f0e", "#9467bd"


def has_staleness(summary: pa.Table) -> bool:
    """Some step of a :func:`~verl_ext.inspect.summary.summarize` table has a staleness (an asynchronous run's
    trace with policy versions and trainer versions)."""
    return "staleness_mean" in summary.column_names and summary.column("staleness_mean").null_count < summary.num_rows


def staleness_figure(
    trace, progress=None, unread=None, *, jobs: int = 1, ray_address: str | None = None, summary: pa.Table | None = None,
    levels: pa.Table | None = None,
) -> Figure:  # fmt: skip
    """Top: per step, the mean and largest staleness of its responses (trainer_version − policy_version_min)
    and the share of them stale (bars, right axis). Below, by staleness level over every step
    (:func:`verl_ext.inspect.offpolicy.by_staleness`): left, the mean and largest |ratio − 1| over the
    actor-update rows of the level's tokens and the share of them clipped (bars, right axis); right, the mean
    importance weight and the mean |log π_old − log π_rollout| over the level's own tokens, where the run has
    them. UsageError when no step has a staleness. ``summary``, ``levels``: the trace's :func:`summarize` and
    :func:`~verl_ext.inspect.offpolicy.by_staleness` tables, when made already (else made here, with
    ``progress``, ``unread``, ``jobs``, ``ray_address``)."""
    trace = as_trace(trace)
    parallel = {"progress": progress, "unread": unread, "jobs": jobs, "ray_address": ray_address}
    if summary is None:
        summary = summarize(trace, **parallel)
    if not has_staleness(summary):
        raise UsageError("no step has a staleness: the trace records no policy versions (a synchronous run, or a trace before format 11)")
    if levels is None:
        levels = offpolicy.by_staleness(trace, **parallel)
    pooled = levels.filter(levels["step"].is_null()).to_pydict()
    fig = Figure(figsize=(11, 8), layout="constrained")
    axes = fig.subplot_mosaic([["steps", "steps"], ["ratio", "weight"]])
    _per_step(axes["steps"], summary.to_pydict())
    _ratio_by_level(axes["ratio"], pooled)
    _weight_by_level(axes["weight"], pooled)
    fig.suptitle("Staleness: how many weight updates lie between the policy that generated a response and the one trained on it")
    return fig


def _values(column) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in column], dtype=float)


def _per_step(axis, table: dict) -> None:
    steps = table["step"]
    marker = "o" if len(steps) <= 50 else None
    axis.plot(steps, _values(table["staleness_mean"]), marker=marker, markersize=3, color=MEAN_COLOR, label="mean staleness")
    axis.plot(steps, _values(table["staleness_max"]), marker=marker, markersize=3, color=MAX_COLOR, linestyle="--", label="largest staleness")
    share = axis.twinx()
    share.bar(steps, _values(table["stale_share"]), color=SHARE_COLOR, alpha=0.35, label="share stale (staleness > 0)")
    share.set_ylim(0, 1.05)
    share.set_ylabel("share of the step's responses")
    axis.set_zorder(share.get_zorder() + 1)
    axis.patch.set_visible(False)
    axis.set_xlabel("training step (of the trace: each update its own)")
    axis.set_ylabel("staleness (weight updates)")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.yaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_title("per step: trainer_version − policy_version_min of its responses", fontsize=10)
    _legend(axis, share, "upper left")
    axis.grid(alpha=0.3)


def _levels(axis, pooled: dict) -> None:
    """The staleness levels as ticks, each with its responses."""
    axis.set_xticks(pooled["staleness"], [f"{level}\n{n} resp." for level, n in zip(pooled["staleness"], pooled["responses"])])
    axis.set_xlabel("staleness (responses over every step)")


def _ratio_by_level(axis, pooled: dict) -> None:
    level = pooled["staleness"]
    deviation = _values(pooled["ratio_dev"])
    _levels(axis, pooled)
    axis.set_title("the update by staleness, over every step", fontsize=10)
    if not np.isfinite(deviation).any():
        axis.text(0.5, 0.5, "no actor update table: nothing of the update to show", transform=axis.transAxes, ha="center", color="grey")
        return
    axis.plot(level, deviation, marker="o", markersize=4, color=DEV_COLOR, label="mean |ratio − 1|")
    axis.plot(level, _values(pooled["ratio_dev_max"]), marker="o", markersize=4, color=DEV_COLOR, linestyle="--", label="largest |ratio − 1|")
    clipped = axis.twinx()
    clipped.bar(level, _values(pooled["clip_frac"]), color=CLIP_COLOR, alpha=0.35, width=0.6, label="share of the update rows clipped")
    clipped.set_ylim(0, max(0.05, float(np.nanmax(_values(pooled["clip_frac"]), initial=0))) * 1.4)
    clipped.set_ylabel("share clipped")
    axis.set_zorder(clipped.get_zorder() + 1)
    axis.patch.set_visible(False)
    axis.set_ylabel("|ratio − 1|, ratio = π_θ/π_old")
    _legend(axis, clipped, "upper left")
    axis.grid(alpha=0.3)


def _weight_by_level(axis, pooled: dict) -> None:
    level = pooled["staleness"]
    weight, gap = _values(pooled["is_mean"]), _values(pooled["lp_gap_mean"])
    _levels(axis, pooled)
    axis.set_title("the rollout's policy against π_old by staleness, over every step", fontsize=10)
    gaps = axis
    if np.isfinite(weight).any():
        axis.plot(level, weight, marker="o", markersize=4, color=WEIGHT_COLOR, label="mean importance weight")
        axis.axhline(1, color=WEIGHT_COLOR, linewidth=0.8, linestyle=":")
        axis.set_ylabel("mean importance weight w")
        gaps = axis.twinx() if np.isfinite(gap).any() else None
    if gaps is not None and np.isfinite(gap).any():
        gaps.plot(level, gap, marker="s", markersize=4, color=GAP_COLOR, label="mean |log π_old − log π_rollout|")
        gaps.set_ylabel("mean |ℓ|")
    if not axis.lines and (gaps is None or not gaps.lines):
        axis.text(0.5, 0.5, "no rollout log-probs nor importance weights", transform=axis.transAxes, ha="center", color="grey")
        return
    _legend(axis, gaps if gaps is not axis else None, "upper left")
    axis.grid(alpha=0.3)


def _legend(axis, other, where: str) -> None:
    handles = [h for a in (axis, other) if a is not None for h in a.get_legend_handles_labels()[0]]
    axis.legend(handles=handles, loc=where, frameon=False, fontsize=8)

"""Figures of a trace, as functions that return ``matplotlib.figure.Figure`` objects.

The figures are built without pyplot (no global state, no GUI backend), so they work the same in a
notebook (a returned Figure displays itself) and in ``verl-ext plot`` (Agg, saved as PNG):

* :func:`position_curves`: per token position, the mean value, return and advantage over samples
* :func:`over_steps`: mean score and explained variance (and KL) over training steps
* :func:`value_vs_return`: every valid token's value against its return
* :func:`advantage_heatmap`: one sample's advantages token by token, with the decoded tokens
* :func:`ratio_vs_advantage`: every actor-update row's ratio against its advantage, with vanilla
  PPO's clip regions drawn in: the PPO picture (needs update tables)
* :func:`logprob_change`: log_prob − old_log_prob along one response, per PPO epoch, under its
  advantages (needs update tables)
* :func:`comparison_figure`: the estimators side by side on one step (``verl-ext compare``)
* :func:`critic_heatmap`: steps × position buckets, the explained variance of the values against
  the Monte-Carlo return and the mean |V − G| (:mod:`verl_ext.inspect.critic`; needs values)
* :func:`offpolicy_gap`: how far the rollout engine and the trainer disagree, |log π_old − log π_rollout|
  per step (p50, p99, max) and by position on one step, with what verl's rollout correction did there
  (the rejected share, the mean importance weight; docs/definitions.md#off-policy-tokens; needs the
  rollout's log-probs)
* :func:`staleness_figure`: for verl's asynchronous trainers, the staleness of each step's responses, and
  the update (|ratio − 1|, the share clipped) and the importance weights by staleness
  (:mod:`verl_ext.inspect.plots_staleness`; needs the policy versions, docs/definitions.md#policy-versions)

A figure that draws token text says so in a footnote when a character had to be shown as a code
point, and warns (``FontFallbackWarning``, a :class:`PlotNote`).

Fonts for token text: a CJK-capable font when one is installed, readable escapes when not.

matplotlib's default font (DejaVu Sans) has no CJK glyphs and would draw "是" as an empty box. So
before drawing labels we look for an installed font that has every character needed (preferring
well-known CJK families) and put it first in the font family list, DejaVu Sans after it for the
rest. When no installed font has some characters, those characters are drawn as their code
points (``U+662F``) and the caller is told once, with the fix.
"""

from __future__ import annotations

import functools
import math
import textwrap
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
from matplotlib import colormaps, font_manager, ft2font, rcParams
from matplotlib.cm import ScalarMappable
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from verl_ext.errors import UsageError
from verl_ext.inspect import offpolicy
from verl_ext.inspect.critic import MIN_EV_TOKENS, critic_diagnostics, explained_variance, steps_by_bucket
from verl_ext.inspect.plots_staleness import has_staleness, staleness_figure
from verl_ext.inspect.render import display_width
from verl_ext.step_metrics import DECILES
from verl_ext.steps.layout import Progress, StepData, as_trace
from verl_ext.steps.recorded import RecordedAlgorithm
from verl_ext.inspect.summary import summarize
from verl_ext.inspect.table import CONTINUATION, EMPTY, decoder_for, sample_view
from verl_ext.inspect.unread import UnreadSteps, last_step_that_reads
from verl_ext.steps.update_rows import UpdateRows
from verl_ext.trace.schema import CLIP_DUAL, CLIP_HIGH, CLIP_LOW, CLIP_NONE

VALUE_COLOR, RETURN_COLOR, RAW_COLOR, ADVANTAGE_COLOR = "#1f77b4", "#d62728", "#2ca02c", "#9467bd"
#: Tokens per line of the heatmap, and tokens drawn at most.
HEATMAP_COLUMNS = 16
HEATMAP_MAX_TOKENS = 512
#: Height / width of a heatmap cell: room for the token above its value.
CELL_ASPECT = 0.8
#: Inches: the token heatmap of a short response is at least this wide, so that its footnote fits
#: (the widest text of it, 7 pt), and its title lines wrap at about this many 10 pt characters an inch.
HEATMAP_MIN_WIDTH = 6.5
TITLE_CHARACTERS_PER_INCH = 10
SCATTER_MAX_POINTS = 20_000


class PlotNote(UserWarning):
    """Something a person looking at the figures should know (``verl-ext plot`` prints it)."""


class FontFallbackWarning(PlotNote):
    """Some characters of the token text cannot be drawn with the installed fonts."""


def position_curves(trace, step: int | None = None) -> Figure:
    """Mean value, return and advantages at each token position over the samples of a step."""
    trace = as_trace(trace)
    step = _step(trace, step)
    data = StepData.read(trace, step, ("value", "return", "advantage_raw", "advantage"))
    positions = data.layout.position[data.layout.valid_rows]
    counts = np.bincount(positions)
    x = np.flatnonzero(counts)

    def mean(name: str) -> np.ndarray | None:
        values = data.columns[name]
        return None if values is None else np.bincount(positions, weights=values)[x] / counts[x]

    fig = Figure(figsize=(10, 7.5), layout="constrained")
    top, middle, bottom = fig.subplots(3, 1, sharex=True, height_ratios=[3, 3, 1.4])
    for name, label, color, axis in (
        ("value", "value V(s_t)", VALUE_COLOR, top),
        ("return", "return (critic target)", RETURN_COLOR, top),
        ("advantage_raw", "raw advantage", RAW_COLOR, middle),
        ("advantage", "advantage (trained on)", ADVANTAGE_COLOR, middle),
    ):
        curve = mean(name)
        if curve is not None:
            axis.plot(x, curve, color=color, label=label, linewidth=1.4)
    middle.axhline(0, color="grey", linewidth=0.8)
    top.set_ylabel("mean over samples")
    middle.set_ylabel("mean over samples")
    for axis in (top, middle):
        if axis.lines[int(axis is middle) :]:
            axis.legend(loc="best", frameon=False)
        else:
            axis.text(0.5, 0.5, "not in this run", transform=axis.transAxes, ha="center", color="grey")
        axis.grid(alpha=0.3)
    bottom.fill_between(x, counts[x], step="mid", color="grey", alpha=0.5)
    bottom.set_ylabel("samples")
    bottom.set_xlabel("token position t (0 = first response token)")
    bottom.grid(alpha=0.3)
    fig.suptitle(f"Step {step}: per-position means over {data.layout.samples} samples ({data.tokens:,} valid tokens)")
    return fig


def over_steps(
    trace, progress: Progress | None = None, unread: UnreadSteps | None = None, *, jobs: int = 1, ray_address: str | None = None,
    summary=None,
) -> Figure:  # fmt: skip
    """Mean sequence score (and reward), explained variance of values vs returns, and KL, per step;
    ``unread``: where to note the steps that do not read, left out; ``jobs``, ``ray_address``: the
    steps in parallel (:func:`summarize`); ``summary``: the trace's :func:`summarize` table, when made already."""
    if summary is None:
        summary = summarize(as_trace(trace), progress=progress, unread=unread, jobs=jobs, ray_address=ray_address)
    summary = summary.to_pydict()
    steps = summary["step"]
    has_kl = any(v is not None for v in summary["kl"])
    fig = Figure(figsize=(9, 7.5 if has_kl else 5.5), layout="constrained")
    axes = fig.subplots(3 if has_kl else 2, 1, sharex=True)
    marker = "o" if len(steps) <= 50 else None
    _series(axes[0], steps, summary["score"], "score (task)", RETURN_COLOR, marker)
    _series(axes[0], steps, summary["reward"], "reward (score − β·KL)", "#ff7f0e", marker, dashed=True)
    axes[0].set_ylabel("mean per sample")
    axes[0].legend(loc="best", frameon=False)
    _series(axes[1], steps, summary["explained_var"], "explained variance", VALUE_COLOR, marker)
    axes[1].axhline(0, color="grey", linewidth=0.8)
    axes[1].set_ylabel("1 − Var(R−V)/Var(R)")
    if all(v is None for v in summary["explained_var"]):
        axes[1].text(0.5, 0.5, "no values in this run", transform=axes[1].transAxes, ha="center", color="grey")
    if has_kl:
        _series(axes[2], steps, summary["kl"], "KL per token", "#8c564b", marker)
        axes[2].set_ylabel("mean kl per token")
    axes[-1].set_xlabel("training step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    for axis in axes:
        axis.grid(alpha=0.3)
    fig.suptitle("Over training steps")
    return fig


def value_vs_return(trace, step: int | None = None, max_points: int = SCATTER_MAX_POINTS) -> Figure:
    """Each valid token's value V(s_t) against its return, coloured by position in the response."""
    trace = as_trace(trace)
    step = _step(trace, step)
    data = StepData.read(trace, step, ("value", "return"))
    value, returns = data.columns["value"], data.columns["return"]
    if value is None or returns is None:
        raise UsageError(f"step {step} has no values or returns: nothing to compare (a critic-free estimator?)")
    layout = data.layout
    lengths = layout.valid_counts[layout.valid_sample_index()]
    rank = np.arange(data.tokens) - np.repeat(layout.valid_starts, layout.valid_counts)
    relative = rank / np.maximum(lengths - 1, 1)
    shown = np.arange(data.tokens)
    if data.tokens > max_points:  # a fixed subsample, so the picture is reproducible
        shown = np.sort(np.random.default_rng(0).choice(data.tokens, max_points, replace=False))
    fig = Figure(figsize=(7.5, 6.5), layout="constrained")
    axis = fig.subplots()
    points = axis.scatter(value[shown], returns[shown], c=relative[shown], cmap="viridis", s=6, alpha=0.6, linewidths=0)
    low = float(min(value.min(), returns.min()))
    high = float(max(value.max(), returns.max()))
    axis.plot([low, high], [low, high], color="grey", linestyle="--", linewidth=1, label="return = value")
    axis.set_xlabel("value V(s_t)")
    axis.set_ylabel("return (the critic's target)")
    axis.legend(loc="upper left", frameon=False)
    axis.grid(alpha=0.3)
    fig.colorbar(points, ax=axis, label="position in response (0 first token, 1 last)")
    ev = explained_variance(value, returns)
    subsample = f", {len(shown):,} shown" if len(shown) < data.tokens else ""
    ev_text = "n/a" if ev is None else f"{ev:.3f}"
    fig.suptitle(f"Step {step}: value vs return, {data.tokens:,} tokens{subsample}; explained variance {ev_text}")
    return fig


def advantage_heatmap(
    trace,
    step: int | None = None,
    sample: int = 0,
    tokenizer=None,
    column: str = "advantage",
    max_tokens: int = HEATMAP_MAX_TOKENS,
) -> Figure:
    """One sample's ``column`` (advantage, advantage_raw, return, …) token by token, with the tokens."""
    trace = as_trace(trace)
    step = _step(trace, step)
    view = sample_view(trace, step, sample, decoder_for(trace, tokenizer))
    table = view.table.slice(0, max_tokens).to_pydict()
    values = np.array([np.nan if v is None else v for v in table[column]], dtype=float)
    mask = np.array(table["mask"], dtype=bool)
    tokens = table["token"]
    prompt = (view.prompt_text or "").replace("\n", " ")
    font = label_font([*tokens, prompt])

    n = len(tokens)
    columns = min(HEATMAP_COLUMNS, max(n, 1))
    lines = max(1, math.ceil(n / columns))
    width = max(1.0 + 0.8 * columns, HEATMAP_MIN_WIDTH)
    more = f" (first {max_tokens} of {view.table.num_rows} tokens)" if view.table.num_rows > max_tokens else ""
    title = [f"Step {step}, sample {sample}: {column} per token{more}" + ("; hatched = masked" if not mask.all() else "")]
    if prompt:
        title.append("prompt: " + font.label(prompt[:100] + ("…" if len(prompt) > 100 else "")))
    # wrapped to the figure's width: a line wider than the figure is cut off at both sides
    title = [part for line in title for part in textwrap.wrap(line, int(width * TITLE_CHARACTERS_PER_INCH), max_lines=3, placeholder=" …")]
    fig = Figure(figsize=(width, 1.9 + 0.8 * CELL_ASPECT * lines + 0.2 * max(0, len(title) - 2)), layout="constrained")
    axis = fig.subplots()
    shown = values[mask & np.isfinite(values)]
    limit = float(np.abs(shown).max()) if len(shown) and np.abs(shown).max() > 0 else 1.0
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-limit, vmax=limit)
    cmap = colormaps["RdBu"]
    for i in range(n):
        row, col = divmod(i, columns)
        valid = mask[i] and np.isfinite(values[i])
        face = cmap(norm(values[i])) if valid else (0.92, 0.92, 0.92, 1.0)
        axis.add_patch(
            Rectangle((col, row), 0.96, 0.92, facecolor=face, edgecolor="white", hatch=None if mask[i] else "//")
        )
        ink = "white" if valid and abs(norm(values[i]) - 0.5) > 0.33 else "black" if valid else "grey"
        label = tokens[i] if tokens[i] in (CONTINUATION, EMPTY) else font.label(tokens[i])
        axis.text(col + 0.48, row + 0.40, label, ha="center", va="center", color=ink,
                  fontsize=_fit(label), fontfamily=list(font.families))  # fmt: skip
        axis.text(
            col + 0.06, row + 0.12, str(table["t"][i]), ha="left", va="center", color=ink, fontsize=5.5, alpha=0.8
        )
        if valid:
            axis.text(col + 0.48, row + 0.74, f"{values[i]:+.2f}", ha="center", va="center", color=ink, fontsize=6.5)
    axis.set_xlim(0, columns)
    axis.set_ylim(lines, 0)
    axis.set_aspect(CELL_ASPECT)
    axis.set_axis_off()
    fig.colorbar(
        ScalarMappable(norm=norm, cmap=cmap), ax=axis, label=column, orientation="horizontal", shrink=0.5, aspect=40
    )
    fig.suptitle("\n".join(title), fontfamily=list(font.families), fontsize=10)
    _footnote(fig, font)
    return fig


CLIP_COLORS = {CLIP_NONE: "#7f7f7f", CLIP_LOW: "#1f77b4", CLIP_HIGH: "#d62728", CLIP_DUAL: "#9467bd"}


def ratio_vs_advantage(trace, step: int | None = None, max_points: int = SCATTER_MAX_POINTS) -> Figure:
    """Each actor-update row (every epoch and mini-batch) as (advantage, ratio), coloured by its clip;
    shaded where vanilla PPO clips: ratio > 1+ε_high with A > 0, ratio < 1−ε_low with A < 0, and the
    dual clip ratio > c with A < 0. There the gradient of the token is zero."""
    trace = as_trace(trace)
    step = _step(trace, step)
    if step not in trace.update_steps.get("actor", []):
        raise UsageError(f"step {step} has no actor update table (verl_ext.trace.update=false, or an older trace)")
    table = trace.actor_update(step, ["advantage", "ratio", "clip"]).to_pydict()
    advantage, ratio, clip = np.array(table["advantage"], float), np.array(table["ratio"], float), np.array(table["clip"], object)
    settings = trace.record.update["actor"]  # written with the update tables checked for above
    low, high, c = settings["clip_ratio_low"], settings["clip_ratio_high"], settings["clip_ratio_c"]
    shown = np.arange(len(ratio))
    if len(ratio) > max_points:
        shown = np.sort(np.random.default_rng(0).choice(len(ratio), max_points, replace=False))
    fig = Figure(figsize=(8, 6), layout="constrained")
    axis = fig.subplots()
    left, right = min(float(advantage.min(initial=0)), -1e-3) * 1.05, max(float(advantage.max(initial=0)), 1e-3) * 1.05
    dual = bool(((advantage < 0) & (ratio > c)).any())
    top = max(float(ratio.max(initial=1)), 1 + high, c if dual else 0.0) * 1.05
    bottom = min(float(ratio.min(initial=1)), 1 - low) * 0.95
    axis.fill_between([0, right], 1 + high, top, color=CLIP_COLORS[CLIP_HIGH], alpha=0.08, label=f"clipped high (ratio > {1 + high:g})")
    axis.fill_between([left, 0], bottom, 1 - low, color=CLIP_COLORS[CLIP_LOW], alpha=0.08, label=f"clipped low (ratio < {1 - low:g})")
    if dual:
        axis.fill_between([left, 0], c, top, color=CLIP_COLORS[CLIP_DUAL], alpha=0.08, label=f"dual clip (ratio > c = {c:g})")
    for code, color in CLIP_COLORS.items():
        chosen = shown[clip[shown] == code]
        if len(chosen):
            axis.scatter(advantage[chosen], ratio[chosen], s=8, alpha=0.7, color=color, linewidths=0, label=f"{code} ({len(chosen):,})")
    axis.axhline(1, color="grey", linewidth=0.8)
    axis.axvline(0, color="grey", linewidth=0.8)
    axis.set_xlim(left, right)
    axis.set_ylim(bottom, top)
    axis.set_xlabel("advantage A_t (what the actor trains on)")
    axis.set_ylabel("ratio = π_θ / π_old")
    axis.legend(loc="best", frameon=False, fontsize=8)
    axis.grid(alpha=0.3)
    subsample = f", {len(shown):,} shown" if len(shown) < len(ratio) else ""
    fig.suptitle(f"Step {step}: ratio against advantage, {len(ratio):,} update rows (all epochs){subsample}")
    return fig


def logprob_change(trace, step: int | None = None, sample: int = 0) -> Figure:
    """Along one response: its advantages, and log_prob − old_log_prob per PPO epoch (what the updates
    before each mini-batch had done to each token's probability)."""
    trace = as_trace(trace)
    step = _step(trace, step)
    if step not in trace.update_steps.get("actor", []):
        raise UsageError(f"step {step} has no actor update table (verl_ext.trace.update=false, or an older trace)")
    table = trace.actor_update(step, ["sample", "token_index", "epoch", "log_prob", "old_log_prob", "advantage"]).to_pydict()
    rows = np.array(table["sample"]) == sample
    if not rows.any():
        raise UsageError(f"step {step} has no actor update rows of sample {sample}")
    token, epoch = np.array(table["token_index"])[rows], np.array(table["epoch"])[rows]
    change = (np.array(table["log_prob"], float) - np.array(table["old_log_prob"], float))[rows]
    advantage = np.array(table["advantage"], float)[rows]
    fig = Figure(figsize=(10, 6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[1, 2])
    first = epoch == epoch.min()
    top.bar(token[first], advantage[first], color=[ADVANTAGE_COLOR if a >= 0 else RETURN_COLOR for a in advantage[first]])
    top.axhline(0, color="grey", linewidth=0.8)
    top.set_ylabel("advantage")
    for e in np.unique(epoch):
        chosen = np.argsort(token[epoch == e])
        bottom.plot(token[epoch == e][chosen], change[epoch == e][chosen], marker="o", markersize=3, label=f"epoch {e}")
    bottom.axhline(0, color="grey", linewidth=0.8)
    bottom.set_ylabel("log_prob − old_log_prob")
    bottom.set_xlabel("token position t")
    bottom.legend(loc="best", frameon=False)
    for axis in (top, bottom):
        axis.grid(alpha=0.3)
    fig.suptitle(f"Step {step}, sample {sample}: how the update moved each token's log-prob")
    return fig


def comparison_figure(comparison) -> Figure:
    """The estimators of a :class:`verl_ext.inspect.comparison.Comparison`: where each puts the credit
    (share of Σ|A| per position), how much its advantages vary (over the batch, and within a
    prompt's group), and how the estimators correlate."""
    labels = list(comparison.labels)
    shares = comparison.shares.to_pydict()
    stats = comparison.statistics.to_pydict()
    fig = Figure(figsize=(13, 4.8), layout="constrained")
    left, middle, right = fig.subplots(1, 3, width_ratios=[2.2, 1.3, 1.3])
    for label in labels:
        left.plot(shares["token_index"], shares[label], marker="o", markersize=3, label=label)
    left.set_xlabel("token position t")
    left.set_ylabel("share of the step's Σ|A|")
    left.legend(loc="best", frameon=False, fontsize=8)
    left.grid(alpha=0.3)
    x = np.arange(len(labels))
    batch = [np.nan if v is None else v for v in stats["var_batch"]]
    within = [np.nan if v is None else v for v in stats["var_within_group"]]
    middle.bar(x - 0.2, batch, width=0.4, label="over the batch", color=VALUE_COLOR)
    middle.bar(x + 0.2, within, width=0.4, label="within a prompt's group", color=RETURN_COLOR)
    middle.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    middle.set_ylabel("variance of the raw advantage")
    middle.legend(loc="best", frameon=False, fontsize=8)
    middle.grid(alpha=0.3, axis="y")
    matrix = np.array([comparison.correlation.column(label).to_numpy() for label in labels])
    image = right.imshow(matrix, cmap="RdBu", vmin=-1, vmax=1)
    right.set_xticks(x, labels, rotation=45, ha="right", fontsize=8)
    right.set_yticks(x, labels, fontsize=8)
    for i in range(len(labels)):
        for j in range(len(labels)):
            right.text(j, i, f"{matrix[i, j]:.2f}", ha="center", va="center", fontsize=6.5)
    fig.colorbar(image, ax=right, shrink=0.8, label="correlation over valid tokens")
    fig.suptitle(f"Step {comparison.step}: the estimators re-estimated from the step's rewards and values")
    return fig


#: Steps up to which the critic heatmap writes each cell's number into it.
CRITIC_ANNOTATE_STEPS = 30


def critic_heatmap(trace, progress: Progress | None = None, unread: UnreadSteps | None = None, *, jobs: int = 1, ray_address: str | None = None) -> Figure:
    """Two heatmaps, steps (rows, downwards) × position buckets (columns: deciles of each response,
    its last valid token, all): the explained variance 1 − Var(G − V)/Var(G) of the values against
    the Monte-Carlo return, its colour clipped to [−1, 1] and diverging around 0 (white: the critic
    explains nothing; red: below 0, V adds error; blue: towards 1, ready), and the mean |V − G|.
    Grey: undefined (an EV of fewer than MIN_EV_TOKENS tokens, returns that do not vary, no tokens),
    as the EV panel's title says. Needs values (UsageError without). ``unread``: where to note the
    steps that do not read, left out; ``jobs``, ``ray_address``: the steps in parallel (:func:`critic_diagnostics`)."""
    trace = as_trace(trace)
    diagnostics = critic_diagnostics(trace, progress=progress, unread=unread, jobs=jobs, ray_address=ray_address)
    panels = (
        ("explained_var", f"explained variance 1 − Var(G − V) / Var(G)\n(grey: fewer than {MIN_EV_TOKENS} tokens, or G does not vary)",
         "colour clipped to [−1, 1]", colormaps["RdBu"]),
        ("mean_abs_error", "mean |V − G|", "reward units", colormaps["viridis"]),
    )
    first = steps_by_bucket(diagnostics, panels[0][0])
    steps, buckets = first.column("step").to_pylist(), first.column_names[1:]
    fig = Figure(figsize=(13, 2.8 + 0.28 * min(len(steps), 60)), layout="constrained")
    for axis, (metric, title, unit, cmap) in zip(fig.subplots(1, 2), panels):
        wide = steps_by_bucket(diagnostics, metric)
        matrix = np.array([[np.nan if v is None else v for v in wide.column(b).to_pylist()] for b in buckets], float).T
        scale = dict(vmin=-1.0, vmax=1.0) if metric == "explained_var" else {}
        image = axis.imshow(matrix, cmap=cmap.with_extremes(bad="0.85"), aspect="auto", interpolation="nearest", **scale)
        if len(steps) <= CRITIC_ANNOTATE_STEPS:
            for (i, j), value in np.ndenumerate(matrix):
                if np.isfinite(value):
                    ink = "white" if sum(image.cmap(image.norm(value))[:3]) < 1.2 else "black"
                    axis.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6.5, color=ink)
        boundaries = [buckets.index("last"), buckets.index("all")] + ([buckets.index("all") + 1] if buckets[-1] != "all" else [])
        for edge in boundaries:  # deciles | last | all | the turns, if any
            axis.axvline(edge - 0.5, color="white", linewidth=2)
        axis.set_xticks(range(len(buckets)), buckets)
        axis.set_yticks(*_step_ticks(steps))
        axis.set_xlabel("position: deciles of each response's valid tokens, its last valid token, all; each turn's first token")
        axis.set_ylabel("training step")
        axis.set_title(title, fontsize=10)
        fig.colorbar(image, ax=axis, label=unit, extend="both" if scale else "neither", shrink=0.9)
    gamma = RecordedAlgorithm.from_record(trace.record).gamma
    fig.suptitle(f"Is the critic ready? Values V against the Monte-Carlo return G (γ = {gamma:g}), by position")
    return fig


#: The gap's quantiles (summary's columns, offpolicy.by_decile's keys) and their colours.
GAP_QUANTILES = (("p50", "lp_gap_p50", "gap_p50", VALUE_COLOR), ("p99", "lp_gap_p99", "gap_p99", ADVANTAGE_COLOR), ("max", "lp_gap_max", "gap_max", RETURN_COLOR))
REJECTED_COLOR, WEIGHT_COLOR = "#8c8c8c", "#ff7f0e"


def has_rollout_log_probs(summary) -> bool:
    """Some step of a :func:`summarize` table has the rollout's log-probs (a gap)."""
    return summary.column("lp_gap_max").null_count < summary.num_rows


def offpolicy_gap(
    trace, step: int | None = None, progress: Progress | None = None, unread: UnreadSteps | None = None, *,
    jobs: int = 1, ray_address: str | None = None, summary=None,
) -> Figure:  # fmt: skip
    """How far the rollout engine and the trainer disagree (docs/definitions.md#off-policy-tokens), on the
    policy's own tokens (valid or rejected). Top: per step, the p50, p99 and max of |ℓ_t| = |log π_old −
    log π_rollout| (``summary``'s lp_gap_* columns), on a log scale. Below, at ``step``: the same by position,
    per decile of each response's own tokens (:func:`verl_ext.inspect.offpolicy.by_decile`), and beside it,
    where the run has them, the share of each decile's tokens verl's rejection took out (bars) and their mean
    importance weight (line). A gap of exactly 0 (bypass mode: π_old := π_rollout) cannot sit on a log
    scale; the panel says so. UsageError when no step has the rollout's log-probs. ``summary``: the
    trace's :func:`summarize` table, when made already (else made here, with ``progress``, ``unread``,
    ``jobs``, ``ray_address``)."""
    trace = as_trace(trace)
    step = _step(trace, step)
    if summary is None:
        summary = summarize(trace, progress=progress, unread=unread, jobs=jobs, ray_address=ray_address)
    if not has_rollout_log_probs(summary):
        raise UsageError("no step has the rollout's log-probs (rollout_log_prob): nothing to compare π_old with")
    decile = offpolicy.by_decile(StepData.read(trace, step, offpolicy.COLUMNS), RecordedAlgorithm.from_record(trace.record).correction)
    corrected = decile is not None and ("rejected" in decile or "is_mean" in decile)
    fig = Figure(figsize=(11, 8), layout="constrained")
    axes = fig.subplot_mosaic([["steps", "steps"], ["gap", "correction"]] if corrected else [["steps"], ["gap"]])
    table = summary.to_pydict()
    marker = "o" if len(table["step"]) <= 50 else None
    zeros = {"steps": False, "gap": False}  # a gap of 0 somewhere, left out of the log scale
    for label, column, _, color in GAP_QUANTILES:
        zeros["steps"] |= _positive(axes["steps"], table["step"], table[column], f"|ℓ| {label}", color, marker)
    axes["steps"].set_xlabel("training step")
    axes["steps"].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes["steps"].set_title("|ℓ| = |log π_old − log π_rollout| over the policy's tokens, per step", fontsize=10)
    gap = axes["gap"]
    if decile is None:
        gap.text(0.5, 0.5, f"step {step} has no rollout log-probs", transform=gap.transAxes, ha="center", color="grey")
    else:
        for label, _, key, color in GAP_QUANTILES:
            zeros["gap"] |= _positive(gap, range(len(DECILES)), decile[key], f"|ℓ| {label}", color, "o")
        gap.set_xticks(range(len(DECILES)), DECILES)
        gap.set_xlabel("decile of each response's own tokens (valid or rejected)")
        gap.set_title(f"step {step}: |ℓ| by position", fontsize=10)
    if corrected:
        _correction_by_decile(axes["correction"], decile, step)
    for name, axis in (("steps", axes["steps"]), ("gap", gap)):
        axis.set_ylabel("|ℓ| (log scale)")
        if axis.lines:
            axis.set_yscale("log")
            axis.legend(loc="best", frameon=False, fontsize=8)
        axis.grid(alpha=0.3)
        if zeros[name] and axis.lines:
            axis.text(0.01, 0.02, f"|ℓ| = 0 at some {name if name == 'steps' else 'deciles'}: not drawn on the log scale",
                      transform=axis.transAxes, fontsize=7.5, color="dimgrey")  # fmt: skip
        elif zeros[name]:
            axis.text(0.5, 0.5, "|ℓ| = 0 on every token: π_old = π_rollout exactly (bypass mode?)", transform=axis.transAxes, ha="center", color="grey")
    fig.suptitle("Off-policy tokens: how far the rollout engine and the trainer disagree, and what verl's rollout correction did")
    return fig


def _positive(axis, x, values, label, color, marker) -> bool:
    """Draw ``values`` (None or NaN: not there) where positive, for a log scale; True when a 0 was left out."""
    y = np.array([np.nan if v is None else v for v in values], dtype=float)
    zeros = bool((y == 0).any())
    y[y <= 0] = np.nan
    if np.isfinite(y).any():
        axis.plot(list(x), y, marker=marker, markersize=3, color=color, label=label)
    return zeros


def _correction_by_decile(axis, decile: dict, step: int) -> None:
    """The rejected share (bars) and the mean importance weight (line, its own axis on the right when
    both are there) of each decile."""
    x = np.arange(len(DECILES))
    weights = axis
    if "rejected" in decile:
        axis.bar(x, decile["rejected"], color=REJECTED_COLOR, alpha=0.7, label="rejected share")
        axis.set_ylabel("share of the decile's tokens rejected")
        axis.set_ylim(0, max(1e-3, float(np.nanmax(decile["rejected"], initial=0))) * 1.35)  # room for the legend
        weights = axis.twinx() if "is_mean" in decile else None
    if weights is not None:
        weights.plot(x, decile["is_mean"], marker="o", markersize=3, color=WEIGHT_COLOR, label="mean importance weight")
        weights.axhline(1, color=WEIGHT_COLOR, linewidth=0.8, linestyle="--")
        weights.set_ylabel("mean importance weight w")
    handles = [h for a in dict.fromkeys((axis, weights)) if a is not None for h in a.get_legend_handles_labels()[0]]
    axis.legend(handles=handles, loc="upper left", frameon=False, fontsize=8)
    axis.set_xticks(x, DECILES)
    axis.set_xlabel("decile of each response's own tokens (valid or rejected)")
    axis.set_title(f"step {step}: verl's rollout correction by position", fontsize=10)
    axis.grid(alpha=0.3, axis="y")


def _step_ticks(steps: list[int], most: int = 30) -> tuple[list[int], list[str]]:
    """Row positions and labels of at most ``most`` evenly spread steps."""
    rows = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), most)).round().astype(int)) if steps else []
    return list(rows), [str(steps[i]) for i in rows]


def save_plots(
    trace,
    out_dir,
    step: int | None = None,
    sample: int = 0,
    tokenizer=None,
    progress: Progress | None = None,
    unread: UnreadSteps | None = None,
    *,
    jobs: int = 1,
    ray_address: str | None = None,
) -> list[Path]:
    """Write every figure as a PNG under ``out_dir``; return the paths written. The figures over the
    steps read them in ``jobs`` processes or as Ray tasks (:func:`verl_ext.trace.parallel.map_steps`).

    Figures that do not apply to the run (value vs return and the critic heatmap without values) are
    left out, with a note; the off-policy figure without the rollout's log-probs and the staleness figure without
    policy versions, without one. Nothing is written unless every figure that applies could be drawn. Without ``step``
    (the last step that reads), the ratio against advantage is drawn at :func:`most_clipped_step`, and
    a :class:`PlotNote` says which when that is another step. ``unread``: where to note the steps whose
    files do not read, which the figures over steps then leave out (without it, such a step raises
    :class:`~verl_ext.errors.StepFileError`).
    """
    trace = as_trace(trace)
    chosen = step
    if step is None and unread is not None:
        step = last_step_that_reads(trace, unread)[0]
    step = _step(trace, step)
    summary = functools.cache(lambda: summarize(trace, progress=progress, unread=unread, jobs=jobs, ray_address=ray_address))
    figures = {
        f"positions_step{step}.png": lambda: position_curves(trace, step),
        "over_steps.png": lambda: over_steps(trace, summary=summary()),
        f"value_vs_return_step{step}.png": lambda: value_vs_return(trace, step),
        f"advantages_step{step}_sample{sample}.png": lambda: advantage_heatmap(trace, step, sample, tokenizer),
        "critic_ev.png": lambda: critic_heatmap(trace, progress, unread, jobs=jobs, ray_address=ray_address),
        # only for a run whose steps have the rollout's log-probs (none: not drawn, no note)
        f"offpolicy_step{step}.png": lambda: offpolicy_gap(trace, step, summary=summary()) if has_rollout_log_probs(summary()) else None,
        # only for an asynchronous run's trace with policy versions (none: not drawn, no note)
        "staleness.png": lambda: staleness_figure(trace, progress, unread, jobs=jobs, ray_address=ray_address, summary=summary())
        if has_staleness(summary()) else None,
    }
    ratio_step = step if chosen is not None else most_clipped_step(trace, unread)
    if ratio_step is not None and ratio_step != step:  # the last step's ratios may all sit at 1 (the lr decayed)
        clipped, rows = _clipped_rows(trace, ratio_step)
        warnings.warn(f"ratio_vs_advantage is drawn at step {ratio_step}, the step with the most clipped update rows ({clipped:,} of {rows:,})", PlotNote, stacklevel=2)
    if ratio_step is not None:
        figures[f"ratio_vs_advantage_step{ratio_step}.png"] = lambda: ratio_vs_advantage(trace, ratio_step)
    if step in trace.update_steps.get("actor", []):
        figures[f"logprob_change_step{step}_sample{sample}.png"] = lambda: logprob_change(trace, step, sample)
    built = {}  # every figure first: a bad step or sample writes nothing
    for name, build in figures.items():
        try:
            figure = build()
            if figure is not None:
                built[name] = figure
        except UsageError as skipped:
            if name.startswith(("value_vs_return", "logprob_change", "critic_ev")):
                warnings.warn(f"{name} left out: {skipped}", PlotNote, stacklevel=2)
                continue
            raise
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, fig in built.items():
        fig.savefig(out / name, dpi=130)
    return [out / name for name in built]


def most_clipped_step(trace, unread: UnreadSteps | None = None) -> int | None:
    """The step whose actor update clipped the most rows (the earliest of equals; the last step when
    none clipped); None without actor update tables. ``unread``: where to note a step whose update
    table does not read, which is then left out (without it, it raises StepFileError)."""
    steps = trace.update_steps.get("actor", [])
    if unread is not None:
        steps = [step for step in steps if step not in unread.unreadable]
    if not steps:
        return None
    if unread is None:
        clipped = {step: _clipped_rows(trace, step)[0] for step in steps}
    else:
        clipped = {step: rows[0] for step, rows in unread.read(steps, lambda step: _clipped_rows(trace, step))}
        steps = [step for step in steps if step in clipped]
        if not steps:
            return None
    most = max(clipped.values())
    return next(step for step in steps if clipped[step] == most) if most else steps[-1]


def _clipped_rows(trace, step: int) -> tuple[int, int]:
    """(clipped rows, rows) of the step's actor update table."""
    rows = UpdateRows.read(trace, "actor", step, ["clip"])
    return int(rows.clipped().sum()), rows.count


def save_plots_with_notes(
    trace,
    out_dir,
    step: int | None = None,
    sample: int = 0,
    tokenizer=None,
    progress: Progress | None = None,
    unread: UnreadSteps | None = None,
    *,
    jobs: int = 1,
    ray_address: str | None = None,
) -> tuple[list[Path], list[str]]:
    """:func:`save_plots`, and what a person should know about the figures (the :class:`PlotNote`
    warnings, and a tokenizer that could not be loaded), each note once: (paths, notes). The steps
    left out are in ``unread`` (:func:`save_plots`)."""
    decoder = decoder_for(trace, tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlotNote)
        paths = save_plots(trace, out_dir, step, sample, decoder, progress, unread, jobs=jobs, ray_address=ray_address)
    notes = [str(w.message) for w in caught if issubclass(w.category, PlotNote)]
    if not decoder.available:
        notes.insert(0, f"{decoder.problem}; the heatmap shows token ids")
    return paths, list(dict.fromkeys(notes))


# ---------------------------------------------------------------------- helpers


def _step(trace, step: int | None) -> int:
    if not trace.steps:
        raise UsageError(f"{trace.path} has no traced steps yet")
    if step is None:
        return trace.steps[-1]
    return trace.require_step(step)


def _series(axis, steps, values, label, color, marker, dashed=False) -> None:
    y = np.array([np.nan if v is None else v for v in values], dtype=float)
    if np.isfinite(y).any():
        axis.plot(steps, y, marker=marker, markersize=3, color=color, label=label, linestyle="--" if dashed else "-")


def _fit(label: str) -> float:
    """Font size that keeps a token label inside its cell."""
    width = max(display_width(label), 1)
    return 10.0 if width <= 4 else max(4.5, 10.0 * 4 / width)


def _footnote(fig: Figure, font: LabelFont) -> None:
    if font.note:
        fig.supxlabel(f"Characters without a glyph in the installed fonts are\n{FIX}.", fontsize=7, color="dimgrey")
        warnings.warn(font.note, FontFallbackWarning, stacklevel=3)


# --------------------------------------------------------------------------- fonts for token text

#: Checked first, in this order; any other installed font with the glyphs also works.
PREFERRED_FAMILIES = (
    "Noto Sans CJK SC", "Noto Sans CJK JP", "Noto Sans SC", "Source Han Sans SC", "Source Han Sans CN",
    "WenQuanYi Zen Hei", "WenQuanYi Micro Hei", "Droid Sans Fallback", "Sarasa Gothic SC", "SimHei",
    "Microsoft YaHei", "PingFang SC", "Hiragino Sans GB", "AR PL UMing CN", "Arial Unicode MS",
)  # fmt: skip
#: How to get real glyphs; shown in the figure itself (which cannot show the characters) too.
FIX = "shown as U+XXXX code points; install a CJK font (e.g. Debian's fonts-noto-cjk) to see them"
#: Fonts whose glyphs are placeholders, not characters.
_PLACEHOLDER_FONTS = ("Last Resort",)


@dataclass(frozen=True)
class LabelFont:
    """The font family list for token labels and the characters it cannot draw."""

    families: tuple[str, ...]
    missing: frozenset[str]

    @property
    def note(self) -> str | None:
        """What was replaced and how to fix it (for a terminal); None when nothing was."""
        if not self.missing:
            return None
        shown = "".join(sorted(self.missing)[:12]) + ("…" if len(self.missing) > 12 else "")
        return f"no installed font has glyphs for {len(self.missing)} character(s) ({shown}): in plots they are {FIX}"

    def label(self, text: str) -> str:
        """``text`` with each character this font cannot draw written as its code point, set apart
        from its neighbours by spaces (U+662F U+7684, 1+1=2 U+FF1F)."""
        if not self.missing:
            return text
        parts = [f" U+{ord(ch):04X} " if ch in self.missing else ch for ch in text]
        return " ".join("".join(parts).split(" ")).strip().replace("  ", " ")


def label_font(texts: Iterable[str]) -> LabelFont:
    """The best font family list for drawing all of ``texts``."""
    default = _default_font_path()
    needed = {ch for text in texts for ch in text if not ch.isspace()}
    missing = {ch for ch in needed if ord(ch) not in _charmap(default)}
    if not missing:
        return LabelFont(tuple(rcParams["font.family"]), frozenset())
    best_name, best_missing = None, missing
    for name, path in _candidate_fonts():
        left = {ch for ch in best_missing if ord(ch) not in _charmap(path)}
        if len(left) < len(best_missing):
            best_name, best_missing = name, left
            if not left:
                break
    families = ((best_name,) if best_name else ()) + (font_manager.FontProperties(fname=default).get_name(),)
    return LabelFont(families, frozenset(best_missing))


def _default_font_path() -> str:
    return font_manager.findfont(font_manager.FontProperties(family=rcParams["font.family"]))


def _candidate_fonts() -> list[tuple[str, str]]:
    """(family name, file) of installed fonts, preferred CJK families first."""
    fonts = {
        entry.name: entry.fname
        for entry in font_manager.fontManager.ttflist
        if not any(entry.name.startswith(p) for p in _PLACEHOLDER_FONTS)
    }
    rank = {name: i for i, name in enumerate(PREFERRED_FAMILIES)}
    return sorted(fonts.items(), key=lambda item: rank.get(item[0], len(rank)))


@functools.lru_cache(maxsize=None)
def _charmap(path: str) -> frozenset[int]:
    try:
        return frozenset(ft2font.FT2Font(path).get_charmap())
    except (OSError, RuntimeError):
        return frozenset()

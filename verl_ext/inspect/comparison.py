"""The estimators side by side on one traced step, re-estimated from its recorded rewards and values.

Nothing is retrained: every estimator of :mod:`verl_ext.registry` runs on the step's ``reward`` and
``value`` columns (float64, the code path of training), so the differences are the estimators'
alone. Compared: every registered estimator at the settings its entry asks for (``mc``, ``td0``,
``nstep<n>``, ``gae<λ>`` for a few λ, then a user's estimator under its name at its options'
defaults), and the run's own estimator at the run's settings (under its own label when it is none of
those). All numbers are raw advantages (before whitening), on valid tokens:

* the per-token table of one sample, one column per estimator;
* per estimator: ``var_batch`` (variance over every valid token of the step), ``var_within_group``
  (the same variance over the valid tokens of one prompt's group of responses, averaged over the
  groups of at least two responses: what is left once the prompt is known; empty with one
  response per prompt), ``mean_abs`` (mean |A|);
* ``shares``: per token position, the share of the step's Σ|A| at that position (where the credit lands);
* ``correlation``: between estimators, over the step's valid tokens.

Cut responses (docs/definitions.md#truncated-responses) are treated as ``truncation`` says, by
default as the run did (its ``algorithm.truncation``; ``terminal`` for a run that did not say). On a
step with cut responses, the run's own estimator is also shown under each of the three treatments:

* ``treatments``: one row per treatment the trace can recompute (``bootstrap`` needs the recorded
  V(s_L), ``bootstrap_value``): the cut responses' mean return and mean advantage before whitening
  (0 under ``mask``), their share of the step's Σ|A|, and, when the run whitens, the mean whitened
  advantage of the cut responses and of the rest (``mask`` leaves the cut ones out of μ and σ);
* ``by_treatment``: the per-token advantages (before whitening) of the sample under each treatment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from verl_ext.errors import UsageError
from verl_ext.inspect.render import render
from verl_ext.step_metrics import prompt_groups
from verl_ext.steps.as_run import DEFAULT_LAMBDAS, DEFAULT_N, as_run, step_estimates
from verl_ext.steps.cuts import SECTION, StepCuts
from verl_ext.steps.layout import StepData, StepLayout, as_trace
from verl_ext.steps.recorded import RecordedAlgorithm
from verl_ext.trace.reader import listing
from verl_ext.truncation import TRUNCATION_MODES

@dataclass(frozen=True)
class Comparison:
    step: int
    sample: int
    labels: tuple[str, ...]  # one per estimator, in column order
    table: pa.Table  # the sample: token_index, token, mask, reward, value, then one column per label
    statistics: pa.Table  # one row per estimator: estimator, var_batch, var_within_group, mean_abs
    shares: pa.Table  # one row per position: token_index, then one column per label
    correlation: pa.Table  # one row per estimator: estimator, then one column per label
    notes: tuple[str, ...] = field(default=())
    truncation: str = "terminal"  # how the estimator columns treat cut responses
    #: the run's estimator under each treatment (module docstring); None on a step without a cut response
    treatments: pa.Table | None = None
    by_treatment: pa.Table | None = None  # the sample: token_index, token, then one column per treatment
    cut: tuple[int, ...] = ()  # the step's cut samples

    def figure(self):
        """Shares of |A| per position, the variances, and the correlations, as a matplotlib Figure."""
        from verl_ext.inspect.plots import comparison_figure

        return comparison_figure(self)


def compare(
    trace,
    step: int,
    sample: int = 0,
    n: int = DEFAULT_N,
    lambdas: tuple[float, ...] = DEFAULT_LAMBDAS,
    tokenizer=None,
    truncation: str | None = None,
) -> Comparison:
    """The estimators side by side on ``step`` (see the module docstring); ``sample`` for the per-token
    table; ``truncation`` the treatment of cut responses in the estimator columns (None: the run's)."""
    from verl_ext.inspect.table import decoder_for

    if truncation is not None and truncation not in TRUNCATION_MODES:
        raise UsageError(f"truncation must be one of {', '.join(TRUNCATION_MODES)}, got {truncation!r}")
    if n < 1:
        raise UsageError(f"n must be an integer >= 1, got {n}")
    if any(not 0.0 <= lam <= 1.0 for lam in lambdas):
        raise UsageError(f"every λ must be in [0, 1], got {', '.join(map(str, lambdas))}")
    trace = as_trace(trace)
    trace.require_step(step)
    algorithm = RecordedAlgorithm.from_record(trace.record)
    data = StepData.read(trace, step, ("reward", "value"))
    if data.columns["reward"] is None or data.columns["value"] is None:
        raise UsageError(f"step {step} has no rewards or values to re-estimate from (a critic-free run?)")
    mode = algorithm.truncation if truncation is None else truncation
    cuts = StepCuts.read(trace, step, data.layout)
    if cuts.why_not(mode):
        raise UsageError(f"step {step} cannot be re-estimated with truncation={mode}: {cuts.why_not(mode)}")
    raw, notes = step_estimates(data, algorithm, n, lambdas, cuts=cuts, mode=mode)
    labels = tuple(raw)

    layout = data.layout
    token_sample = layout.valid_sample_index()
    sample_ids = layout.sample_ids[token_sample]
    position = layout.token_index[layout.valid_rows]
    chosen = sample_ids == sample
    if not chosen.any():
        raise UsageError(f"step {step} has no valid tokens of sample {sample} (samples: 0 … {layout.samples - 1})")
    extra = trace.read_step(step, ["token_id", "uid"])  # same rows as the step data, in the same order
    token_ids = [extra["token_id"][int(row)].as_py() for row in layout.valid_rows[chosen]]
    decoder = decoder_for(trace, tokenizer)
    pieces = decoder.pieces(token_ids) if None not in token_ids else ["?"] * len(token_ids)
    table = pa.table({
        "token_index": position[chosen].astype(np.int32),
        "token": pa.array(pieces, pa.string()),
        "reward": data.columns["reward"][chosen],
        "value": data.columns["value"][chosen],
        **{label: raw[label][chosen] for label in labels},
    })  # fmt: skip

    uid = np.array(extra["uid"].to_pylist(), dtype=object)[layout.valid_rows]
    statistics, more_notes = estimator_statistics(raw, uid, sample_ids)
    notes += more_notes
    positions = np.arange(int(position.max()) + 1 if len(position) else 0)
    shares = {"token_index": positions.astype(np.int32)}
    for label in labels:
        total = np.abs(raw[label]).sum()
        per_position = np.bincount(position, weights=np.abs(raw[label]), minlength=len(positions))
        shares[label] = per_position / total if total > 0 else np.full(len(positions), np.nan)
    matrix = np.corrcoef(np.stack([raw[label] for label in labels])) if len(position) > 1 else np.full((len(labels),) * 2, np.nan)
    correlation = pa.table({"estimator": list(labels), **{label: matrix[:, i] for i, label in enumerate(labels)}})
    treated = treatment_comparison(data, algorithm, cuts, chosen, table.select(["token_index", "token"]))
    notes += treated.notes
    return Comparison(
        step, sample, labels, table, statistics, pa.table(shares), correlation, tuple(notes),
        mode, treated.statistics, treated.by_token, treated.cut,
    )  # fmt: skip


def comparison_report(comparison: Comparison, fmt: str = "text", digits: int = 4) -> str:
    """``comparison`` as ``verl-ext compare`` prints it, in ``fmt`` (``render``'s formats) with floats
    to ``digits`` decimals (the correlations to 2). CSV: the per-token table alone, without its
    ``reward`` and ``value`` columns. Text and Markdown: a heading then a table, for the per-token
    table, ``statistics``, ``shares``, ``correlation``, and on a step with cut responses
    ``treatments`` and ``by_treatment``; then one ``note:`` line per note; blank lines between."""
    if fmt == "csv":
        return render(comparison.table.drop_columns(["reward", "value"]), "csv")
    treated = "" if comparison.truncation == "terminal" else f", cut responses treated as truncation={comparison.truncation}"
    sections = [
        f"step {comparison.step}, sample {comparison.sample}: raw advantages (before whitening) by estimator{treated}",
        render(comparison.table, fmt, digits),
        "per estimator, over the step's valid tokens:",
        render(comparison.statistics, fmt, digits),
        "share of the step's Σ|A| per position:",
        render(comparison.shares, fmt, digits),
        "correlation between estimators:",
        render(comparison.correlation, fmt, 2),
        *_treatment_sections(comparison, fmt, digits),
        *(f"note: {note}" for note in comparison.notes),
    ]
    return "\n\n".join(sections)


def _treatment_sections(comparison: Comparison, fmt: str, digits: int) -> list[str]:
    """The run's estimator under each treatment of cut responses, when the step has some."""
    if comparison.treatments is None:
        return []
    cut = comparison.cut
    which = f"sample{'s' * (len(cut) != 1)} {listing(list(cut))}"
    sample = "cut" if comparison.sample in cut else "not cut"
    return [
        f"responses cut at the length limit: {len(cut)} ({which}; docs/definitions.md#truncated-responses); the run's "
        "estimator under each truncation, over the step's valid tokens (adv: before whitening, 0 under mask):",
        render(comparison.treatments, fmt, digits),
        f"sample {comparison.sample} ({sample}): advantages before whitening under each truncation",
        render(comparison.by_treatment, fmt, digits),
    ]


@dataclass(frozen=True)
class TreatmentComparison:
    statistics: pa.Table | None
    by_token: pa.Table | None
    cut: tuple[int, ...]
    notes: list[str]


def treatment_comparison(data: StepData, algorithm: RecordedAlgorithm, cuts: StepCuts, chosen: np.ndarray, sample_columns: pa.Table) -> TreatmentComparison:
    """The run's estimator under each treatment of cut responses (module docstring): ``chosen`` marks
    the valid tokens of the per-token table's sample, ``sample_columns`` its first columns."""
    if not cuts.recorded:
        return TreatmentComparison(None, None, (), [f"truncated responses are not compared: the trace records no truncated flags ({SECTION})"])
    layout = data.layout
    cut_samples = tuple(int(s) for s in layout.sample_ids[cuts.cut & (layout.valid_counts > 0)])
    if not cut_samples:
        return TreatmentComparison(None, None, (), [])
    if not algorithm.recomputable:
        return TreatmentComparison(None, None, cut_samples, [f"truncated responses are not compared: {algorithm.why_not}"])
    on_cut = cuts.at_tokens(layout)
    notes, rows, by_token = [], [], {}
    for mode in TRUNCATION_MODES:
        problem = cuts.why_not(mode)
        if problem:
            notes.append(f"truncation={mode} is not compared: {problem}")
            continue
        treated = as_run(data, algorithm, cuts, mode=mode)
        advantages = treated.before_whitening
        total = np.abs(advantages).sum()
        row = {
            "treatment": mode,
            "cut_mean_return": float(treated.returns[on_cut].mean()),
            "cut_mean_adv": float(advantages[on_cut].mean()),
            "cut_share_abs": float(np.abs(advantages[on_cut]).sum() / total) if total > 0 else None,
        }
        if treated.whitened_tokens is not None:
            white = None if treated.whitening is None else treated.advantages
            row["cut_adv_whitened"] = None if white is None else float(white[on_cut].mean())
            row["rest_adv_whitened"] = None if white is None or on_cut.all() else float(white[~on_cut].mean())
        rows.append(row)
        by_token[mode] = advantages[chosen]
    statistics = pa.Table.from_pylist(rows)
    return TreatmentComparison(statistics, _with_columns(sample_columns, by_token), cut_samples, notes)


def _with_columns(table: pa.Table, columns: dict[str, np.ndarray]) -> pa.Table:
    for name, values in columns.items():
        table = table.append_column(name, pa.array(values, pa.float64()))
    return table


def estimator_statistics(raw: dict[str, np.ndarray], uid: np.ndarray, sample_ids: np.ndarray) -> tuple[pa.Table, list[str]]:
    """The ``statistics`` table of a step (module docstring) from its re-estimated ``raw`` advantages,
    with the ``uid`` (any hashable, or integer group codes) and sample of every valid token (a
    missing uid: each sample is its own group)."""
    labels = list(raw)
    groups = _group_codes(uid, sample_ids)
    statistics = pa.table({
        "estimator": labels,
        "var_batch": pa.array([float(np.var(raw[label], ddof=1)) if len(raw[label]) > 1 else None for label in labels], pa.float64()),
        "var_within_group": pa.array([_within_group_variance(raw[label], groups) for label in labels], pa.float64()),
        "mean_abs": pa.array([float(np.mean(np.abs(raw[label]))) if len(raw[label]) else None for label in labels], pa.float64()),
    })  # fmt: skip
    notes = []
    if statistics.column("var_within_group").null_count == len(labels):
        notes.append("no prompt has two responses at this step: var_within_group is empty")
    return statistics, notes


def step_estimator_statistics(raw: dict[str, np.ndarray], layout: StepLayout, prompts: pa.Table) -> tuple[pa.Table, list[str]]:
    """:func:`estimator_statistics` of a step's re-estimated ``raw`` advantages (at ``layout``'s valid
    tokens), each response in the group of its uid in the step's prompt table ``prompts``."""
    uids = dict(zip(prompts.column("sample").to_pylist(), prompts.column("uid").to_pylist()))
    token_sample = layout.valid_sample_index()
    uid = np.array([uids.get(sample) for sample in layout.sample_ids.tolist()], dtype=object)[token_sample]
    return estimator_statistics(raw, uid, layout.sample_ids[token_sample])


def _group_codes(groups: np.ndarray, samples: np.ndarray) -> np.ndarray | None:
    """0 … G−1 per token for the groups of at least two responses, −1 for the others; None if there
    is no such group. A group's uid is the same on all its tokens, so it is factorised per sample."""
    if not len(samples):
        return None
    first = np.flatnonzero(np.r_[True, samples[1:] != samples[:-1]])  # tokens of a sample are contiguous
    per_sample = groups[first]
    if per_sample.dtype == object and any(g is None for g in per_sample):  # a missing uid: each sample alone
        per_sample = samples[first]
    codes = prompt_groups(per_sample)
    # one sample may appear as several runs only in a malformed trace: count distinct samples per group
    distinct = np.unique(np.stack([codes, samples[first].astype(np.int64)], axis=1), axis=0)[:, 0]
    sizes = np.bincount(distinct, minlength=int(codes.max()) + 1)
    kept = sizes > 1
    if not kept.any():
        return None
    renumber = np.where(kept, np.cumsum(kept) - 1, -1)
    return np.repeat(renumber[codes], np.diff(np.r_[first, len(samples)]))


def _within_group_variance(values: np.ndarray, groups: np.ndarray | None) -> float | None:
    """Mean over the groups of at least two responses (codes ≥ 0) of the variance (n − 1) of the
    group's values."""
    if groups is None:
        return None
    member = groups >= 0
    codes, x = groups[member], values[member]
    count = np.bincount(codes)
    mean = np.bincount(codes, weights=x) / count
    squares = np.bincount(codes, weights=(x - mean[codes]) ** 2)
    with np.errstate(invalid="ignore", divide="ignore"):
        variances = squares / (count - 1)
    return float(np.mean(variances))

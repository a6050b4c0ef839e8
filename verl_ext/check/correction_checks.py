"""The identities of verl's rollout correction (docs/definitions.md#off-policy-tokens), on one step's
token table: the importance weights and the rejection recomputed from the recorded log-probs by
verl's definitions (:mod:`verl_ext.rollout_correction`, in float64), bypass mode's π_old = π_rollout,
and verl's own logged ``rollout_corr/…`` numbers of the step recomputed from its rows
(:func:`verl_ext.offpolicy_metrics.verls_logged`).

Both are computed over the policy's own tokens (``mask`` ∨ ``rejected``: verl corrects the response
mask before its rejection), densely, one row per sample. A weight is checked within the float32 error
bound of its computation; where a recomputed weight or rejection statistic lies within that bound of a
threshold (an IcePop bound, a rejection bound), either outcome is the trainer's rounding and passes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from verl_ext.check.results import ATOL, Finding, Location, Tolerance, Violation, skipped

if TYPE_CHECKING:
    from verl_ext.check.token_checks import TokenStep

#: Where every message about the correction points.
SECTION = "docs/definitions.md#off-policy-tokens"
#: The weights' tolerance as the report writes it (the bound itself: rollout_correction.weight_error_bound).
WEIGHT = Tolerance(f"{ATOL:g} + w·(float32 error of its exponent + ε)")
#: The rejection's: exact, but a statistic within its float32 error of a threshold may fall either way.
THRESHOLD = Tolerance("exact; either side within a statistic's float32 error of its bound")
#: verl's logged numbers: float32 means of n terms (fractions: exact counts).
LOGGED = Tolerance(f"{ATOL:g} + ε·n·max|term|")


def _dense(t: "TokenStep", name: str) -> np.ndarray:
    """(samples, width) float64 of column ``name`` at every row (0 where null or past a sample's rows)."""
    layout = t.data.layout
    out = np.zeros((layout.samples, int(layout.row_counts.max()) if layout.samples else 0))
    column = t.data.table.column(name)
    if column.null_count < len(column):
        out[layout.row_sample, layout.position] = column.cast(pa.float64()).fill_null(0.0).to_numpy(zero_copy_only=False)
    return out


def _own(t: "TokenStep") -> np.ndarray:
    layout = t.data.layout
    own = np.zeros((layout.samples, int(layout.row_counts.max()) if layout.samples else 0), bool)
    own[layout.row_sample, layout.position] = layout.own
    return own


def _absent(t: "TokenStep", *names: str) -> str | None:
    """Which of the columns the identity reads the step lacks (null on every row), as a note."""
    table = t.data.table
    missing = [name for name in names if table.column(name).null_count == table.num_rows]
    return f"{', '.join(missing)} not in the trace (a trace before format 10, or a rollout that reported no log-probs)" if missing else None


def _noted(finding: Finding, t: "TokenStep") -> Finding:
    """``finding``, noting that the ratio is biased where the rollout sampled from a truncated distribution."""
    sampling = t.algorithm.truncated_sampling
    if sampling is None:
        return finding
    said = f"the rollout sampled with {sampling}: its log-probs are of the truncated, renormalised distribution, " \
           f"which biases the ratio π_old/π_rollout ({SECTION})"  # fmt: skip
    return dataclasses.replace(finding, note=said if finding.note is None else f"{finding.note}; {said}")


def _located(t: "TokenStep", sample_index: int, position: int) -> Location:
    layout = t.data.layout
    row = int(layout.starts[sample_index] + position)
    return Location(t.step, *t.data.row_location(row))


def is_weights(t: "TokenStep") -> Finding:
    """The recorded rollout_is_weight = verl's weight recomputed from old_log_prob − rollout_log_prob."""
    import torch

    from verl_ext.rollout_correction import is_weights as recompute, weight_error_bound

    correction = t.correction
    if correction is None or correction.rollout_is is None:
        return skipped("no importance weights configured (algorithm.rollout_correction.rollout_is)")
    if correction.bypass_mode:
        return skipped("bypass mode: verl computes the weights inside the loss, against π_θ (the update table's is_weight)")
    if (missing := _absent(t, "old_log_prob", "rollout_log_prob", "rollout_is_weight")) is not None:
        return Finding("fail", violations=1, first=Violation(Location(t.step), "rollout_is_weight", detail=missing), note=missing)
    if correction.batch_normalize and (kept := t._kept_part()) is not None:
        return skipped(f"traced {kept[0]} of {kept[1]} samples: the batch's mean weight cannot be recomputed")
    own = _own(t)
    log_ratio = torch.from_numpy(_dense(t, "old_log_prob") - _dense(t, "rollout_log_prob"))
    mask = torch.from_numpy(own.astype(np.float64))
    expected = recompute(log_ratio, mask, correction).numpy()
    bound = ATOL + weight_error_bound(log_ratio, mask, correction).numpy()
    actual = _dense(t, "rollout_is_weight")
    recorded = np.zeros_like(own)
    recorded[t.data.layout.row_sample, t.data.layout.position] = True  # rows past a sample's end are not compared
    wrong = recorded & ~(np.abs(actual - expected) <= bound)
    if correction.is_lower is not None:  # IcePop: a weight within its bound of l or u may be kept or zeroed
        raw = recompute(log_ratio, mask, _without_band(correction)).numpy()
        near = (np.abs(raw - correction.is_lower) <= bound) | (np.abs(raw - correction.is_upper) <= bound)
        wrong &= ~(near & ((np.abs(actual) <= bound) | (np.abs(actual - raw) <= bound)))
    first = None
    if wrong.any():
        i, j = np.argwhere(wrong)[0]
        error = float(abs(actual[i, j] - expected[i, j]))
        first = Violation(_located(t, i, j), "rollout_is_weight", float(actual[i, j]), float(expected[i, j]), error, float(bound[i, j]))
    compared = np.abs(actual - expected)[recorded]
    return _noted(Finding(
        "fail" if wrong.any() else "pass", checked=int(recorded.sum()), violations=int(wrong.sum()),
        max_abs_error=float(compared.max()) if compared.size else None, first=first,
    ), t)  # fmt: skip


def _without_band(correction):
    """``correction`` without IcePop's band (the weights before it zeroes any)."""
    import dataclasses

    return dataclasses.replace(correction, is_lower=None, is_upper=float("inf"))


def rejection(t: "TokenStep") -> Finding:
    """The recorded rejected tokens = the policy's tokens verl's rejection options do not keep."""
    import torch

    from verl_ext.rollout_correction import kept, rejection_statistic, statistic_error_bound

    correction = t.correction
    if correction is None or not correction.rejection:
        return skipped("no rejection configured (algorithm.rollout_correction.rollout_rs)")
    if correction.bypass_mode:
        return skipped("bypass mode: verl rejects inside the loss, against π_θ; the batch's mask is not changed")
    if (missing := _absent(t, "old_log_prob", "rollout_log_prob", "rejected")) is not None:
        return Finding("fail", violations=1, first=Violation(Location(t.step), "rejected", detail=missing), note=missing)
    own = _own(t)
    log_ratio = torch.from_numpy(_dense(t, "old_log_prob") - _dense(t, "rollout_log_prob"))
    mask = torch.from_numpy(own.astype(np.float64))
    expected = own & ~kept(log_ratio, mask, correction).numpy()
    ambiguous = np.zeros_like(own)
    for option in correction.rejection:
        statistic = rejection_statistic(log_ratio, mask, option).numpy()
        bound = statistic_error_bound(log_ratio, mask, option).numpy()
        for threshold in (option.lower, option.upper):
            if threshold is not None:
                ambiguous |= np.abs(statistic - threshold) <= bound
    actual = _dense(t, "rejected") != 0
    wrong = own & (actual != expected) & ~ambiguous
    wrong |= ~own & actual  # a hole is never rejected (cannot happen: rejected rows are the policy's)
    first = None
    if wrong.any():
        i, j = np.argwhere(wrong)[0]
        detail = f"recorded {'rejected' if actual[i, j] else 'kept'}; verl's options {', '.join(o.name for o in correction.rejection)} say " \
                 f"{'rejected' if expected[i, j] else 'kept'} ({SECTION})"  # fmt: skip
        first = Violation(_located(t, i, j), "rejected", detail=detail)
    note = f"{int((own & actual).sum())} of {int(own.sum())} of the policy's tokens rejected"
    if ambiguous.any():
        note += f"; {int((own & ambiguous).sum())} within rounding of a threshold, either outcome accepted"
    return _noted(Finding("fail" if wrong.any() else "pass", checked=int(own.sum()), violations=int(wrong.sum()), first=first, note=note), t)


def bypass(t: "TokenStep") -> Finding:
    """Bypass mode: the old log-probs are the rollout's, exactly (verl's apply_bypass_mode)."""
    correction = t.correction
    if correction is None or not correction.bypass_mode:
        return skipped("not bypass mode (algorithm.rollout_correction.bypass_mode)")
    if (missing := _absent(t, "old_log_prob", "rollout_log_prob")) is not None:
        return Finding("fail", violations=1, first=Violation(Location(t.step), "rollout_log_prob", detail=missing), note=missing)
    own = _own(t)
    old, rollout = _dense(t, "old_log_prob"), _dense(t, "rollout_log_prob")
    wrong = own & (old != rollout)
    first = None
    if wrong.any():
        i, j = np.argwhere(wrong)[0]
        first = Violation(_located(t, i, j), "old_log_prob", float(old[i, j]), float(rollout[i, j]), float(abs(old[i, j] - rollout[i, j])), 0.0)
    return _noted(Finding("fail" if wrong.any() else "pass", checked=int(own.sum()), violations=int(wrong.sum()), first=first), t)


def logged_numbers(t: "TokenStep") -> Finding:
    """verl's logged ``rollout_corr/…`` and ``training/rollout_probs_diff_…`` numbers of the step = the same
    definitions over its rows."""
    from verl_ext.check.results import DTYPE_EPS, EPS32, compare
    from verl_ext.offpolicy_metrics import CORRECTION_PREFIX, PROBS_DIFF_PREFIX, verls_logged, verls_probs_diff

    recorded = getattr(t.step_record, "logged", None) or {}
    logged = {key: value for key, value in recorded.items() if key.startswith((CORRECTION_PREFIX, PROBS_DIFF_PREFIX))}
    if not logged:
        return skipped("no rollout_corr/… or rollout_probs_diff_… numbers of verl's recorded at this step (a trace before format "
                       "10, or a replay of another rollout correction, whose numbers verl did not compute)")
    if (kept := t._kept_part()) is not None:
        return skipped(f"traced {kept[0]} of {kept[1]} samples: verl's numbers are over the whole batch")
    data, correction = t.data, t.correction
    old, rollout = data.at_own_tokens("old_log_prob"), data.at_own_tokens("rollout_log_prob")
    if old is None or rollout is None:
        return unchecked_for("old_log_prob or rollout_log_prob is not in the trace")
    weights = data.at_own_tokens("rollout_is_weight")
    rejected = data.at_own_tokens("rejected") if correction is not None and correction.rejection else None
    normalised = correction is not None and correction.batch_normalize  # verl's weight numbers are before it
    ours = {
        CORRECTION_PREFIX + name: value
        for name, value in verls_logged(
            old, rollout, data.layout.own_counts, t.step_record.batch_samples, None if normalised else weights,
            None if correction is None else correction.is_upper, None if rejected is None else rejected != 0,
        ).items()
    }  # fmt: skip
    # verl's calculate_debug_metrics runs before the correction, over the policy's own tokens
    ours |= {"training/" + name: value for name, value in verls_probs_diff(old, rollout).items()}
    names = [name for name in ours if name in logged]
    if not names:
        return skipped("none of verl's logged numbers of the step is one verl-ext recomputes")
    n, gap = len(old), np.abs(old - rollout)
    magnitude = {"kl": gap.max(), "k3_kl": np.abs(np.expm1(old - rollout) - (old - rollout)).max()}
    if weights is not None:
        # ESS = 1 / mean((w/mean w)²) ≤ 1: two float32 means and a division, each off by ε·n at most
        magnitude |= {"rollout_is_mean": weights.max(), "rollout_is_eff_sample_size": 3.0}
    # |exp(a) − exp(b)| ≤ 1, each exp rounded once in float32: ε per term, then the float32 sums (std: its square's)
    magnitude |= {"rollout_probs_diff_max": 2.0 / max(n, 1), "rollout_probs_diff_mean": 2.0, "rollout_probs_diff_std": 4.0}
    tolerance = np.array([ATOL + EPS32 * n * float(magnitude.get(name.rpartition("/")[2], 0.0)) for name in names])
    note = None
    if held := t._held_in("old_log_prob"):
        # verl takes exp of the log-probs in the dtype they are held in (V1 keeps them in bf16): each exp(old)
        # rounded there, half an ulp, δ = ε/2·exp(old) per token (docs/definitions.md#in-a-bf16-run)
        delta = DTYPE_EPS.get(held, EPS32) / 2 * np.exp(old.astype(np.float64))
        rounding = {"rollout_probs_diff_max": delta.max(), "rollout_probs_diff_mean": delta.mean(),
                    "rollout_probs_diff_std": np.sqrt((delta**2).sum() / max(n - 1, 1))}  # fmt: skip
        tolerance += np.array([float(rounding.get(name.rpartition("/")[2], 0.0)) for name in names])
        note = f"old_log_prob held in {held} by the trainer, exp(old) rounded there: + ε/2·exp(old) per token"
    return compare([logged[name] for name in names], [ours[name] for name in names], tolerance, lambda i: (Location(t.step), names[i]), note)


def unchecked_for(why: str) -> Finding:
    from verl_ext.check.results import unchecked

    return unchecked(f"{why} ({SECTION})")

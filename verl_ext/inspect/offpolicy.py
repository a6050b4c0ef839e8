"""A traced step's off-policy numbers (docs/definitions.md#off-policy-tokens): how far the rollout
engine and the trainer disagree on the policy's own tokens, and what verl's rollout correction did,
by :func:`verl_ext.offpolicy_metrics.offpolicy_metrics` (the function the live metrics run on the
trainer's batch), for ``summary``, its notes and the live metrics recomputed from a trace; and by
position (:func:`by_decile`, ``verl-ext plot``'s off-policy figure)."""

from __future__ import annotations

import numpy as np

from verl_ext.offpolicy_metrics import offpolicy_metrics
from verl_ext.step_metrics import DECILES, Responses
from verl_ext.steps.layout import StepData

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

"""A traced step's off-policy numbers (docs/definitions.md#off-policy-tokens): how far the rollout
engine and the trainer disagree on the policy's own tokens, and what verl's rollout correction did,
by :func:`verl_ext.offpolicy_metrics.offpolicy_metrics` (the function the live metrics run on the
trainer's batch), for ``summary``, its notes and the live metrics recomputed from a trace."""

from __future__ import annotations

from verl_ext.offpolicy_metrics import offpolicy_metrics
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

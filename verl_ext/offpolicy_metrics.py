"""How far the rollout engine and the trainer disagree on one step, and what verl's rollout correction
did there (docs/definitions.md#off-policy-tokens): the per-step numbers of ``summary``, of the live
metrics (``verl_ext/offpolicy/…``) and of the identity that holds verl's own logged ``rollout_corr/…``
numbers to the trace. Numpy in, numbers out; no verl, no torch.

And, for verl's asynchronous trainers (docs/definitions.md#policy-versions), how stale a step's responses
are (:func:`staleness_metrics`): from each response's policy versions and the version its update starts from.

A step is given over the policy's own tokens (valid, or rejected by the correction: the ones verl
corrects), response by response, with ``lengths[b]`` such tokens in response b (0 for none):
``old``, ``rollout`` the log-probs log π_old and log π_rollout, ``weights`` verl's importance weights
(None: none configured), ``rejected`` which of them the rejection took out (None: none configured).
"""

from __future__ import annotations

import numpy as np

#: The live metrics' names (under verl_ext/), each a quantity of :func:`offpolicy_metrics`.
GAP_P50, GAP_P99, GAP_MAX = "offpolicy/lp_gap_p50", "offpolicy/lp_gap_p99", "offpolicy/lp_gap_max"
KL = "offpolicy/kl"
IS_MEAN, IS_ESS, IS_TRUNCATED = "offpolicy/is_mean", "offpolicy/is_ess", "offpolicy/is_truncated"
REJECTED_TOKENS, REJECTED_RESPONSES = "offpolicy/rejected_tokens", "offpolicy/rejected_responses"
#: The live metrics' names of :func:`staleness_metrics`.
STALENESS_MEAN, STALENESS_MAX = "offpolicy/staleness_mean", "offpolicy/staleness_max"
STALE_SHARE, SPANNED_SHARE = "offpolicy/stale_share", "offpolicy/spanned_share"
#: The prefixes of the numbers verl logs of a step's off-policy gap: its rollout correction's
#: (verl/trainer/ppo/rollout_corr_helper.py) and its debug metrics' (verl/utils/debug/metrics.py).
CORRECTION_PREFIX, PROBS_DIFF_PREFIX = "rollout_corr/", "training/rollout_probs_diff_"
#: verl's warning levels for a step (verl's docs/algo/rollout_corr.md): (metric, test, what the docs say)
WARNINGS = (
    (IS_MEAN, lambda x: not 0.5 <= x <= 2.0, "mean IS weight outside [0.5, 2]"),
    (IS_ESS, lambda x: x < 0.3, "effective sample size < 0.3"),
    (KL, lambda x: abs(x) > 0.1, "|KL(π_rollout ‖ π_old)| > 0.1"),
)


def offpolicy_metrics(
    old: np.ndarray, rollout: np.ndarray, lengths: np.ndarray, weights: np.ndarray | None = None,
    upper: float | None = None, rejected: np.ndarray | None = None,
) -> dict[str, float]:
    """The step's numbers (none without a token):

    * lp_gap_p50, _p99, _max: quantiles of |log π_old − log π_rollout| over the policy's tokens;
    * kl = mean(log π_rollout − log π_old), KL(π_rollout ‖ π_old) estimated as verl's ``rollout_corr/kl``;
    * with ``weights``: is_mean = mean w; is_ess = 1 / mean((w̃/mean w̃)²), w̃ = min(w, ``upper``) (verl's
      effective sample size, 1 when every weight is equal); is_truncated = the share of tokens whose weight
      is not the ratio exp(log π_old − log π_rollout), truncated (TIS), zeroed (IcePop) or normalised;
    * with ``rejected``: rejected_tokens = its share of the tokens, rejected_responses = the share of the
      responses with a token that has one rejected.
    """
    if not len(old):
        return {}
    gap = np.abs(old - rollout)
    metrics = {
        GAP_P50: float(np.quantile(gap, 0.5)), GAP_P99: float(np.quantile(gap, 0.99)), GAP_MAX: float(gap.max()),
        KL: float(np.mean(rollout - old)),
    }  # fmt: skip
    if weights is not None:
        clamped = np.minimum(weights, np.inf if upper is None else upper)
        mean = clamped.mean()
        ratio = np.exp(np.clip(old - rollout, -20.0, 20.0))
        metrics |= {
            IS_MEAN: float(weights.mean()),
            IS_ESS: float(1.0 / np.mean(np.square(clamped / (mean + 1e-8)))) if mean > 0 else 0.0,
            IS_TRUNCATED: float(np.mean(~np.isclose(weights, ratio, rtol=1e-5, atol=0.0))),
        }
    if rejected is not None:
        per_response = np.add.reduceat(rejected.astype(np.int64), _starts(lengths))
        metrics |= {REJECTED_TOKENS: float(rejected.mean()), REJECTED_RESPONSES: float(np.mean(per_response > 0))}
    return metrics


def warnings(metrics: dict[str, float]) -> list[str]:
    """The warning levels of verl's docs/algo/rollout_corr.md that ``metrics`` (:func:`offpolicy_metrics`) cross."""
    return [f"{text} ({metrics[name]:.3g})" for name, crossed, text in WARNINGS if name in metrics and crossed(metrics[name])]


def verls_logged(
    old: np.ndarray, rollout: np.ndarray, lengths: np.ndarray, batch_samples: int,
    weights: np.ndarray | None = None, upper: float | None = None, rejected: np.ndarray | None = None,
) -> dict[str, float]:
    """What verl logs under these names (``rollout_corr/…``, without the prefix), by its definitions
    (verl/trainer/ppo/rollout_corr_helper.py), over the same tokens: kl, k3_kl = mean(e^ℓ − ℓ − 1) of
    ℓ = log π_old − log π_rollout unclamped; rollout_is_mean, rollout_is_eff_sample_size (as
    :func:`offpolicy_metrics`' is_mean and is_ess); rollout_rs_masked_fraction (the rejected tokens' share),
    rollout_rs_seq_masked_fraction (the responses with one, over all ``batch_samples`` rows of the batch,
    those without a token included, as verl divides)."""
    if not len(old):
        return {}
    ours = offpolicy_metrics(old, rollout, lengths, weights, upper, rejected)
    log_ratio = old - rollout
    logged = {"kl": ours[KL], "k3_kl": float(np.mean(np.exp(log_ratio) - log_ratio - 1.0))}
    if weights is not None:
        logged |= {"rollout_is_mean": ours[IS_MEAN], "rollout_is_eff_sample_size": ours[IS_ESS]}
    if rejected is not None:
        responses = int((lengths > 0).sum())
        logged |= {
            "rollout_rs_masked_fraction": ours[REJECTED_TOKENS],
            "rollout_rs_seq_masked_fraction": ours[REJECTED_RESPONSES] * responses / batch_samples,
        }
    return logged


def staleness_metrics(trainer_version, version_min, version_max=None) -> dict[str, float]:
    """How stale a step's responses are (docs/definitions.md#policy-versions), over the responses whose
    version is known: ``version_min`` (``version_max``), per response, the version of the weights that
    generated its first (last) token, as verl tags them (``non_tensor_batch["min_global_steps"]``, an object
    array of ints; None, NaN or a negative number where unknown) or as the prompt table holds them;
    ``trainer_version``: the version the update starts from (None: unknown, and so is every number).

    * staleness_mean, staleness_max: of trainer_version − version_min, each response's staleness;
    * stale_share: the share of the responses with a staleness above 0;
    * with ``version_max``, spanned_share: the share whose generation spanned a weight update (max > min).

    Empty without a trainer version or a response whose version is known."""
    if trainer_version is None:
        return {}
    low = versions(version_min)
    known = np.isfinite(low)
    if not known.any():
        return {}
    staleness = float(trainer_version) - low[known]
    metrics = {
        STALENESS_MEAN: float(staleness.mean()), STALENESS_MAX: float(staleness.max()), STALE_SHARE: float(np.mean(staleness > 0)),
    }  # fmt: skip
    if version_max is not None:
        high = versions(version_max)[known]
        metrics[SPANNED_SHARE] = float(np.mean(np.isfinite(high) & (high > low[known])))
    return metrics


def versions(values) -> np.ndarray:
    """Policy versions as float64, NaN where unknown (None, NaN, a negative number): verl's object arrays
    of ints, a prompt table's column as numpy (NaN where null), or a list."""
    out = np.array([np.nan if v is None else float(v) for v in np.asarray(values, dtype=object).ravel()], np.float64)
    out[out < 0] = np.nan
    return out


def verls_probs_diff(old: np.ndarray, rollout: np.ndarray) -> dict[str, float]:
    """What verl logs as ``training/rollout_probs_diff_max``, ``_mean`` and ``_std`` (without the prefix), by its
    definition (verl/utils/debug/metrics.py): d = |exp(log π_old) − exp(log π_rollout)| over the same tokens, a
    difference of probabilities although its helper is named for log-probs; std with n − 1, as torch.std."""
    if not len(old):
        return {}
    d = np.abs(np.exp(old) - np.exp(rollout))
    spread = float(np.std(d, ddof=1)) if len(d) > 1 else float("nan")
    return {"rollout_probs_diff_max": float(d.max()), "rollout_probs_diff_mean": float(d.mean()), "rollout_probs_diff_std": spread}


def _starts(lengths: np.ndarray) -> np.ndarray:
    """Each response's first index among the tokens (responses without one left out)."""
    return (np.cumsum(lengths) - lengths)[lengths > 0]

"""The live metrics (:mod:`verl_ext.step_metrics`) of verl's batch, trace or no trace.

Every step, on the driver, from the batch verl holds once it has its advantages: the critic against
the Monte-Carlo return (overall, at each response's last token, by decile and, on multi-turn steps,
at the start of each assistant turn), the advantage's spread and whitening, the spread of the
scores within prompt groups, and where the credit lands (on multi-turn steps also per turn); named
``verl_ext/…`` in verl's metrics, so every logger of ``trainer.logger`` shows them
(docs/definitions.md §9). The advantage step (:func:`verl_ext.integration.step.advantage`) calls
:func:`live_metrics` with the raw advantage of the step's estimator (for verl's ``gae``, returns −
values); where there is none (``grpo``, whose normalization is its own) the advantage itself stands
for it. The step returns them to the trainer's call that merges them (:mod:`verl_ext.integration.step`).

Cost: one Monte-Carlo return (the ``mc`` kernel), the compaction of four (B, T) tensors to their valid
tokens (one index, then a take each), and a few passes over those in float64, all on the CPU tensors the driver holds
(benchmarks/bench_metrics.py).
"""

from __future__ import annotations

from typing import Any


def live_metrics(data: Any, gamma: float, advantage_raw: Any, own_mask: Any = None, correction: Any = None) -> dict[str, float]:
    """``verl_ext/…`` -> value for a verl ``DataProto`` holding rewards, advantages (and values,
    returns), computed from its valid tokens by :func:`verl_ext.step_metrics.step_metrics`; the turns
    from ``own_mask``, the response mask before verl's rollout correction rejected tokens (None: none),
    and the off-policy numbers over it (:func:`verl_ext.offpolicy_metrics.offpolicy_metrics`) where the
    batch has the rollout's log-probs; ``correction``: the run's rollout correction, None without one."""
    import numpy as np
    import torch

    from verl_ext import registry
    from verl_ext.step_metrics import Responses, prefixed, step_metrics
    from verl_ext.turns import first_of_each_turn, turn_index, turn_starts

    batch = data.batch
    keys = set(batch.keys())
    mask = batch["response_mask"]
    valid = mask.bool()
    values = batch["values"] if "values" in keys else None
    if advantage_raw is None:
        advantage_raw = batch["advantages"]
    returns = None
    if values is not None:
        mc = registry.get("mc")
        settings = mc.settings({"gamma": gamma})
        returns = registry.run(mc, batch["token_level_rewards"], values, mask, settings, whiten=False).returns

    flat_valid = np.flatnonzero(valid.numpy())  # once: a boolean index per tensor costs ~10× a take

    def at_valid_tokens(tensor):
        if tensor is None:
            return None
        exact = tensor if tensor.dtype in (torch.float32, torch.float64, torch.bool) else tensor.float()
        return exact.reshape(-1).numpy().take(flat_valid)

    lengths = valid.sum(-1).numpy()
    has_tokens = lengths > 0
    scores = uid = None
    if "token_level_scores" in keys:
        # float32 before the sum: a bf16 column is read exactly, and summed in float32
        scores = (batch["token_level_scores"].float() * mask).sum(-1).numpy()[has_tokens]
    if data.non_tensor_batch.get("uid") is not None:
        uid = np.asarray(data.non_tensor_batch["uid"])[has_tokens]
    if own_mask is None:
        starts = at_valid_tokens(turn_starts(mask))
    else:  # a rejected token is the policy's: the turns are the own mask's, their starts its first valid tokens
        rows = np.repeat(np.arange(len(lengths)), lengths)
        starts = first_of_each_turn(rows, at_valid_tokens(turn_index(turn_starts(own_mask))))
    metrics = _offpolicy(batch, keys, mask if own_mask is None else own_mask, correction) | step_metrics(
        Responses.of(lengths, starts),
        returns=at_valid_tokens(returns),
        values=at_valid_tokens(values),
        advantage_raw=at_valid_tokens(advantage_raw),
        advantage=at_valid_tokens(batch["advantages"]),
        scores=scores,
        uid=uid,
    )
    return prefixed(metrics)


def _offpolicy(batch: Any, keys: set, own_mask: Any, correction: Any) -> dict[str, float]:
    """The off-policy numbers over the policy's own tokens ``own_mask`` (empty without the rollout's log-probs)."""
    import numpy as np

    from verl_ext.offpolicy_metrics import offpolicy_metrics

    if "rollout_log_probs" not in keys or "old_log_probs" not in keys:
        return {}
    own = own_mask.bool()
    flat = np.flatnonzero(own.numpy())

    def at_own(tensor):
        return tensor.float().reshape(-1).numpy().take(flat).astype(np.float64)

    weights = at_own(batch["rollout_is_weights"]) if "rollout_is_weights" in keys else None
    rejected = None
    if correction is not None and correction.rejection and not correction.bypass_mode:
        rejected = at_own(own & ~batch["response_mask"].bool()) != 0
    upper = None if correction is None else correction.is_upper
    return offpolicy_metrics(at_own(batch["old_log_probs"]), at_own(batch["rollout_log_probs"]), own.sum(-1).numpy(), weights, upper, rejected)

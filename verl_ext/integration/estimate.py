"""The estimate of an advantage step on verl's batch: verl-ext's estimator, or the raw advantage of verl's own."""

from __future__ import annotations

from typing import Any, Callable

from verl_ext.truncation import Truncation


def compute_registered_advantage(data: Any, name: str, gamma: float, lam: float, config: Any, truncation: Truncation | None = None):
    """Run verl-ext estimator ``name`` on a verl ``DataProto``; store advantages and returns in it.

    verl's batch -> the estimator (with the critic's values) -> whitening -> back into the batch, cut
    responses treated as ``truncation`` says (None: terminal). Returns the :class:`verl_ext.registry.Estimate`.
    """
    from verl_ext import registry

    estimator = registry.get(name)
    batch = data.batch
    values = batch["values"] if "values" in batch.keys() else None
    settings = estimator.settings(config, gamma=gamma, lam=lam)
    try:
        result = registry.run(estimator, batch["token_level_rewards"], values, batch["response_mask"], settings, truncation=truncation)
    except registry.MissingCriticValues as error:
        raise RuntimeError(
            f"algorithm.adv_estimator={name} needs the critic's values, but the batch has none: "
            "the critic is off (check critic.enable) or this trainer did not compute values before advantages"
        ) from error
    batch["advantages"] = result.advantages
    batch["returns"] = result.returns
    return result


def verl_advantage_raw(data: Any, name: str, gamma: float, lam: float, config: Any):
    """The raw advantage of verl's own estimator where it is returns − values (verl's GAE: verl keeps
    only the whitened advantage), for the trace and the live metrics; None where the batch cannot
    tell (grpo, an estimator verl-ext knows nothing about)."""
    from verl_ext import registry

    estimator = registry.lookup(name)
    if estimator is None or not estimator.is_returns_minus_values(estimator.settings(config, gamma=gamma, lam=lam)):
        return None
    return data.batch["returns"].float() - data.batch["values"].float()  # in float32 when verl's are bf16


def compute_verl_advantage_truncated(
    data: Any, name: str, truncation: Truncation, arguments: dict[str, Any], verl_compute_advantage: Callable[[], Any]
):
    """verl's own estimator ``name`` with cut responses treated as ``truncation`` says (not terminal); returns
    the batch with its advantages. verl's numbers stay verl's: its gae runs on the bootstrapped rewards (the
    batch keeps the real ones), and the mask re-whitens its raw advantage; its grpo function runs on the
    responses that were not cut."""
    if name == "gae" and truncation.mode == "bootstrap":
        return _verl_on_bootstrapped_rewards(data, truncation, arguments["gamma"], verl_compute_advantage)
    if name == "gae":
        return _masked_gae(verl_compute_advantage(), truncation)
    if name == "grpo" and truncation.mode == "mask":
        return _masked_grpo(data, truncation, arguments.get("norm_adv_by_std_in_grpo", True))
    raise RuntimeError(f"algorithm.truncation={truncation.mode} does not apply to verl's algorithm.adv_estimator={name}")


def _verl_on_bootstrapped_rewards(data: Any, truncation: Truncation, gamma: float, verl_compute_advantage: Callable[[], Any]):
    """r_{L−1} + γ·V(s_L) is all verl's GAE needs to see of V(s_L); the trace and the reward checks read
    the rewards the reward function gave, so the batch gets them back."""
    batch = data.batch
    rewards = batch["token_level_rewards"]
    batch["token_level_rewards"] = truncation.rewards(rewards, batch["response_mask"], gamma)
    try:
        data = verl_compute_advantage()
    finally:
        data.batch["token_level_rewards"] = rewards
    return data


def _masked_gae(data: Any, truncation: Truncation):
    """verl's GAE whitens its raw advantage returns − values over every response
    (core_algos.compute_gae_advantage_return): again, with verl's masked_whiten, over the uncut ones."""
    from verl.utils import torch_functional as verl_F

    batch = data.batch
    raw = batch["returns"].float() - batch["values"].float()
    batch["advantages"] = truncation.whiten(raw, batch["response_mask"], verl_F.masked_whiten).to(batch["advantages"].dtype)
    return data


def _masked_grpo(data: Any, truncation: Truncation, norm_adv_by_std_in_grpo: bool):
    """verl's grpo function (as compute_advantage calls it) on the responses that were not cut, so that a
    cut response is outside its group's mean and std; 0 on the cut ones (returns = advantages, as verl's)."""
    import torch
    from verl.trainer.ppo import core_algos

    batch = data.batch
    rewards, mask = batch["token_level_rewards"], batch["response_mask"]
    kept = torch.nonzero(~truncation.cut.to(rewards.device)).flatten()
    advantages = torch.zeros(rewards.shape, dtype=rewards.sum(-1).dtype, device=rewards.device)
    if len(kept):
        kept_advantages, _ = core_algos.compute_grpo_outcome_advantage(
            token_level_rewards=rewards[kept],
            response_mask=mask[kept],
            index=data.non_tensor_batch["uid"][kept.cpu().numpy()],
            norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo,
        )
        advantages[kept] = kept_advantages.to(advantages.dtype)
    batch["advantages"] = advantages
    batch["returns"] = advantages
    return data

"""The estimate of an advantage step on verl's batch: verl-ext's estimator, or the raw advantage of verl's own."""

from __future__ import annotations

from typing import Any


def compute_registered_advantage(data: Any, name: str, gamma: float, lam: float, config: Any):
    """Run verl-ext estimator ``name`` on a verl ``DataProto``; store advantages and returns in it.

    verl's batch -> the estimator (with the critic's values) -> whitening -> back into the batch.
    Returns the :class:`verl_ext.registry.Estimate`.
    """
    from verl_ext import registry

    estimator = registry.get(name)
    batch = data.batch
    values = batch["values"] if "values" in batch.keys() else None
    if estimator.needs_critic and values is None:
        raise RuntimeError(
            f"algorithm.adv_estimator={name} needs the critic's values, but the batch has none: "
            "the critic is off (check critic.enable) or this trainer did not compute values before advantages"
        )
    settings = estimator.settings(config, gamma=gamma, lam=lam)
    result = registry.run(estimator, batch["token_level_rewards"], values, batch["response_mask"], settings)
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

"""The verl-facing side of the estimators: the functions put in verl's registry, and the call
that hands them the critic's values.

verl's ``compute_advantage`` (every version up to 0.9.1) calls a registered estimator with only
``token_level_rewards, response_mask, config, index``: never ``values``. The seam therefore
routes these estimator names through :func:`compute_value_based_advantage`, which reads
``values`` from the batch. The registered functions take ``values`` as a keyword and fail with
an explanation when verl calls them without it (a trainer that bypasses the seam).
"""

from __future__ import annotations

from collections import ChainMap
from enum import Enum
from typing import Any, Mapping

import torch

from verl_ext.estimators import Estimate, estimate
from verl_ext.options import ESTIMATOR_NAMES, EstimatorOptions


def estimator_name(adv_estimator: Any) -> str:
    """verl passes a plain string or an ``AdvantageEstimator`` enum member."""
    return adv_estimator.value if isinstance(adv_estimator, Enum) else str(adv_estimator)


def options_from(config: Mapping[str, Any] | None, name: str, gamma: float, lam: float) -> EstimatorOptions:
    """Options from the ``algorithm`` node, with the name, γ and λ verl passed explicitly."""
    return EstimatorOptions.from_config(ChainMap({"adv_estimator": name, "gamma": gamma, "lam": lam}, config or {}))


def compute_value_based_advantage(data: Any, name: str, gamma: float, lam: float, config: Any) -> Estimate:
    """Run estimator ``name`` on a verl ``DataProto`` and store advantages and returns in it."""
    batch = data.batch
    if "values" not in batch.keys():
        raise RuntimeError(
            f"algorithm.adv_estimator={name} needs the critic's values, but the batch has none: "
            "the critic is off (check critic.enable) or this trainer did not compute values before advantages"
        )
    result = estimate(
        batch["token_level_rewards"], batch["values"], batch["response_mask"], options_from(config, name, gamma, lam)
    )
    batch["advantages"] = result.advantages
    batch["returns"] = result.returns
    return result


def _registered(name: str):
    def estimator(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        config: Any = None,
        values: torch.Tensor | None = None,
        **_unused: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if values is None:
            raise RuntimeError(
                f"algorithm.adv_estimator={name} was called without the critic's values. verl never passes "
                "values to a registered estimator; verl-ext routes its estimators around that in "
                "verl.trainer.ppo.ray_trainer.compute_advantage, but this caller bypassed the seam (a trainer "
                "or recipe that bound compute_advantage before verl-ext loaded). Run `verl-ext doctor`."
            )
        gamma = (config or {}).get("gamma", 1.0)
        lam = (config or {}).get("lam", 1.0)
        result = estimate(token_level_rewards, values, response_mask, options_from(config, name, gamma, lam))
        return result.advantages, result.returns

    estimator.__name__ = estimator.__qualname__ = f"verl_ext_{name}"
    return estimator


#: One function object per name, so registering twice (plugin loaded twice) is a no-op in verl.
REGISTERED_FUNCTIONS = {name: _registered(name) for name in ESTIMATOR_NAMES}


def register_estimators(core_algos: Any) -> None:
    """Put the estimators in ``core_algos.ADV_ESTIMATOR_REGISTRY`` (verl 0.4.1 … 0.9.1)."""
    for name, function in REGISTERED_FUNCTIONS.items():
        core_algos.register_adv_est(name)(function)

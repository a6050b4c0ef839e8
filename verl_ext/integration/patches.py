"""The plugin's patches of verl: what each wraps, why, and for which verl versions.

Applied by :mod:`verl_ext.integration.seam` right after each module is first imported, so
modules that ``from ... import`` these names later (verl 0.9's V1 trainer, verl's experimental
trainers, third-party recipes) bind the wrapped versions. Every wrapper delegates to the original
for anything that is not verl-ext's business.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from verl_ext.integration.seam import Patch
from verl_ext.options import ESTIMATOR_NAMES

# The wrappers import what they need when the patched verl module is imported (verl has torch
# loaded by then), so that loading the plugin, or `import verl_ext` for the CLI, stays light.

#: verl versions the plugin's patches are tested with (scripts/check_verl_versions.sh).
SUPPORTED_VERL = ("0.6.1", "0.9.1")
SUPPORTED = " - ".join(SUPPORTED_VERL)


def _wrap_compute_advantage(original: Callable) -> Callable:
    from verl_ext.integration import trace_hook
    from verl_ext.integration.estimators import compute_value_based_advantage, estimator_name

    signature = inspect.signature(original)  # bind by name: the positional order differs across versions

    @functools.wraps(original)
    def compute_advantage(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        data, name = call.arguments["data"], estimator_name(call.arguments["adv_estimator"])
        if name in ESTIMATOR_NAMES:
            arguments = call.arguments
            result = compute_value_based_advantage(
                data, name, arguments["gamma"], arguments["lam"], arguments.get("config")
            )
            trace_hook.after_advantage(data, name, advantage_raw=result.advantage_raw)
            return data
        data = original(*args, **kwargs)
        trace_hook.after_advantage(data, name, advantage_raw=None)
        return data

    return compute_advantage


def _wrap_need_critic(original: Callable) -> Callable:
    from verl_ext.integration.validation import critic_required

    @functools.wraps(original)
    def need_critic(config) -> bool:
        return critic_required(config) or original(config)

    return need_critic


def _wrap_validate_config(original: Callable) -> Callable:
    from verl_ext.integration.validation import check_config

    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        check_config(config)
        return original(config, *args, **kwargs)

    return validate_config


def _wrap_apply_kl_penalty(original: Callable) -> Callable:
    from verl_ext.integration import trace_hook

    @functools.wraps(original)
    def apply_kl_penalty(data, kl_ctrl, *args, **kwargs):
        beta = kl_ctrl.value  # read before the call: the adaptive controller updates itself inside
        data, metrics = original(data, kl_ctrl, *args, **kwargs)
        trace_hook.record_kl(data, beta=beta, kl_penalty=kwargs.get("kl_penalty", args[0] if args else "kl"))
        return data, metrics

    return apply_kl_penalty


def _wrap_fit(trainer_kind: str) -> Callable[[Callable], Callable]:
    def wrap(original: Callable) -> Callable:
        from verl_ext.integration import trace_hook

        @functools.wraps(original)
        def fit(self, *args, **kwargs):
            with trace_hook.session(self, trainer_kind):
                return original(self, *args, **kwargs)

        return fit

    return wrap


def _wrap_v1_compute_advantage(original: Callable) -> Callable:
    from verl_ext.integration import trace_hook

    @functools.wraps(original)
    def _compute_advantage(self, batch, metrics):
        batch = original(self, batch, metrics)
        trace_hook.after_v1_advantage(self, batch)
        return batch

    return _compute_advantage


PLUGIN_PATCHES = [
    Patch(
        "verl.trainer.ppo.ray_trainer",
        "compute_advantage",
        _wrap_compute_advantage,
        why="verl never passes `values` to a registered estimator: mc/td0/nstep/gae_ext are computed here with "
        "the batch's values; every estimator's result is handed to the per-token trace",
        versions=SUPPORTED,
    ),
    Patch(
        "verl.trainer.ppo.utils",
        "need_critic",
        _wrap_need_critic,
        why="verl switches the critic on only for `gae`; value-based estimators need it too, and an explicit "
        "critic.enable=False with one of them must stop the run before training",
        versions=SUPPORTED,
    ),
    Patch(
        "verl.utils.config",
        "validate_config",
        _wrap_validate_config,
        why="verl never validates algorithm.adv_estimator before step 1; check the name, the estimator options and "
        "the trace options on the driver, before Ray starts",
        versions=SUPPORTED,
    ),
    Patch(
        "verl.trainer.ppo.ray_trainer",
        "apply_kl_penalty",
        _wrap_apply_kl_penalty,
        why="the trace records kld_t and the β actually applied at each step; verl keeps neither",
        versions=SUPPORTED,
    ),
    Patch(
        "verl.trainer.ppo.ray_trainer",
        "RayPPOTrainer.fit",
        _wrap_fit("legacy"),
        why="open the trace before the legacy trainer's first step and flush it when fit() ends, even on error",
        versions=SUPPORTED,
    ),
    Patch(
        "verl.trainer.ppo.v1.trainer_base",
        "PPOTrainer.fit",
        _wrap_fit("v1"),
        why="open the trace before the V1 trainer's first step and flush it when fit() ends, even on error",
        versions="0.9.0 - 0.9.1",
    ),
    Patch(
        "verl.trainer.ppo.v1.trainer_base",
        "PPOTrainer._compute_advantage",
        _wrap_v1_compute_advantage,
        why="the V1 trainer computes advantages on a reduced batch without token ids; after it stores them in "
        "TransferQueue, the trace reads back the tensors the trainer will use, with token ids and the step",
        versions="0.9.0 - 0.9.1",
    ),
]

def _register_estimators(core_algos: Any) -> None:
    from verl_ext.integration.estimators import register_estimators

    register_estimators(core_algos)


#: Registrations (not patches): run right after the module is first imported.
PLUGIN_HOOKS: list[tuple[str, Callable[[Any], None]]] = [
    ("verl.trainer.ppo.core_algos", _register_estimators),
]

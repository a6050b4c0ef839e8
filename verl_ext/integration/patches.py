"""The plugin's wrappers of verl functions and its registration into verl's estimator registry.

Each function here is named by a record of :mod:`verl_ext.touches` (which says why and for which
verl versions) and applied by :mod:`verl_ext.patching` right after its verl module is imported.
Every wrapper delegates to the original for anything that is not verl-ext's business. They import
what they need when applied (verl has torch loaded by then), so that loading the plugin stays light.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable

logger = logging.getLogger("verl_ext")


# --------------------------------------------------------------------------- advantages


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


def _verl_advantage_raw(data: Any, name: str, gamma: float, lam: float, config: Any):
    """The raw advantage of verl's own estimator where it is returns − values (verl's GAE: verl keeps
    only the whitened advantage), for the trace and the live metrics; None where the batch cannot
    tell (grpo, an estimator verl-ext knows nothing about)."""
    from verl_ext import registry

    estimator = registry.lookup(name)
    if estimator is None or not estimator.is_returns_minus_values(estimator.settings(config, gamma=gamma, lam=lam)):
        return None
    return data.batch["returns"] - data.batch["values"]


def wrap_compute_advantage(original: Callable) -> Callable:
    from verl_ext import registry
    from verl_ext.integration import metrics_hook, nonfinite_hook, trace_hook, turn_rewards_hook

    signature = inspect.signature(original)  # bind by name: the positional order differs across versions

    @functools.wraps(original)
    def compute_advantage(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        arguments = call.arguments
        data, name = arguments["data"], registry.name_of(arguments["adv_estimator"])
        turn_reward_metrics = turn_rewards_hook.place(data)  # before any estimator reads the rewards
        if name in registry.names():
            result = compute_registered_advantage(data, name, arguments["gamma"], arguments["lam"], arguments.get("config"))
            advantage_raw = result.advantage_raw
        else:
            data = original(*args, **kwargs)
            advantage_raw = _verl_advantage_raw(data, name, arguments["gamma"], arguments["lam"], arguments.get("config"))
        trace_hook.after_advantage(data, advantage_raw=advantage_raw)
        metrics_hook.after_advantage(data, gamma=arguments["gamma"], advantage_raw=advantage_raw, extra=turn_reward_metrics)
        nonfinite_hook.after_advantage(data)  # after the capture: a traced step is kept when this raises
        return data

    return compute_advantage


def _unreachable_estimator(name: str) -> Callable:
    def estimator(*args: Any, **kwargs: Any):
        raise RuntimeError(
            f"algorithm.adv_estimator={name} was called through verl's estimator registry, without the critic's "
            "values. verl never passes values to a registered estimator; verl-ext computes its estimators in "
            "verl.trainer.ppo.ray_trainer.compute_advantage, but this caller bypassed that patch (a trainer or "
            "recipe that bound compute_advantage before verl-ext loaded). Run `verl-ext doctor`."
        )

    estimator.__name__ = estimator.__qualname__ = f"verl_ext_{name}"
    return estimator


#: One function object per name, so that registering twice (plugin loaded twice) is a no-op in verl.
REGISTERED_IN_VERL: dict[str, Callable] = {}
#: Names verl refused (another function holds them there), for doctor.
REFUSED: dict[str, str] = {}


def register_estimators(core_algos: Any) -> None:
    """Put every verl-ext estimator name, now and when registered later, in verl's registry."""
    from verl_ext import registry

    def put(estimator: registry.Estimator, raise_errors: bool) -> None:
        function = REGISTERED_IN_VERL.setdefault(estimator.name, _unreachable_estimator(estimator.name))
        try:
            core_algos.register_adv_est(estimator.name)(function)
        except ValueError as error:  # verl holds another function under this name
            REFUSED[estimator.name] = str(error)
            if raise_errors:
                raise ValueError(f"verl refuses estimator name {estimator.name!r}: {error}") from None
            logger.error("verl-ext: verl refuses estimator name %r: %s", estimator.name, error)

    for estimator in registry.all_estimators():
        put(estimator, raise_errors=False)
    registry.on_register(lambda estimator: put(estimator, raise_errors=True))


# --------------------------------------------------------------------------- critic rule and validation


def wrap_need_critic(original: Callable) -> Callable:
    from verl_ext.integration.validation import critic_required

    @functools.wraps(original)
    def need_critic(config) -> bool:
        return critic_required(config) or original(config)

    return need_critic


def wrap_validate_config(original: Callable) -> Callable:
    from verl_ext.integration.validation import check_config

    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        check_config(config)
        return original(config, *args, **kwargs)

    return validate_config


# --------------------------------------------------------------------------- the trace


def wrap_apply_kl_penalty(original: Callable) -> Callable:
    from verl_ext.integration import trace_hook

    @functools.wraps(original)
    def apply_kl_penalty(data, kl_ctrl, *args, **kwargs):
        beta = kl_ctrl.value  # read before the call: the adaptive controller updates itself inside
        data, metrics = original(data, kl_ctrl, *args, **kwargs)
        trace_hook.record_kl(data, beta=beta, kl_penalty=kwargs.get("kl_penalty", args[0] if args else "kl"))
        return data, metrics

    return apply_kl_penalty


def _wrap_fit(original: Callable, trainer_kind: str) -> Callable:
    from verl_ext.integration import metrics_hook, nonfinite_hook, trace_hook, turn_rewards_hook

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        with (
            nonfinite_hook.session(self),
            metrics_hook.session(self),
            turn_rewards_hook.session(self),
            trace_hook.session(self, trainer_kind),
        ):
            return original(self, *args, **kwargs)

    return fit


def wrap_legacy_fit(original: Callable) -> Callable:
    return _wrap_fit(original, "legacy")


def wrap_v1_fit(original: Callable) -> Callable:
    return _wrap_fit(original, "v1")


def wrap_v1_compute_advantage(original: Callable) -> Callable:
    from verl_ext.integration import metrics_hook, nonfinite_hook, trace_hook, turn_rewards_hook

    @functools.wraps(original)
    def _compute_advantage(self, batch, metrics):
        with nonfinite_hook.deferred():  # verl_ext.nonfinite=raise: once the trace has the step
            turn_rewards_hook.before_v1_advantage(batch)
            batch = turn_rewards_hook.after_v1_advantage(self, original(self, batch, metrics))
            metrics.update(metrics_hook.take())  # the step's metrics, which V1 hands us
            return trace_hook.after_v1_advantage(self, batch)

    return _compute_advantage


# --------------------------------------------------------------------------- the live metrics


def wrap_compute_data_metrics(original: Callable) -> Callable:
    from verl_ext.integration import metrics_hook

    @functools.wraps(original)
    def compute_data_metrics(*args, **kwargs):
        return {**original(*args, **kwargs), **metrics_hook.take()}

    return compute_data_metrics


# --------------------------------------------------------------------------- the update side of the trace


def wrap_ppo_loss(original: Callable) -> Callable:
    from verl_ext.integration.update_hook import traced_ppo_loss

    @functools.wraps(original)
    def ppo_loss(config, model_output, data, dp_group=None):
        return traced_ppo_loss(original, config, model_output, data, dp_group)

    return ppo_loss


def wrap_value_loss(original: Callable) -> Callable:
    from verl_ext.integration.update_hook import traced_value_loss

    @functools.wraps(original)
    def value_loss(config, model_output, data, dp_group=None):
        return traced_value_loss(original, config, model_output, data, dp_group)

    return value_loss


def wrap_make_iterator(original: Callable) -> Callable:
    from verl_ext.integration.update_hook import tagged_make_iterator

    @functools.wraps(original)
    def make_iterator(tensordict, mini_batch_size, epochs, seed=None, dataloader_kwargs=None):
        return tagged_make_iterator(original, tensordict, mini_batch_size, epochs, seed, dataloader_kwargs)

    return make_iterator


def wrap_reduce_metrics(original: Callable) -> Callable:
    from verl_ext.integration import trace_hook

    @functools.wraps(original)
    def reduce_metrics(metrics: dict, *args, **kwargs):
        reports = trace_hook.take_update_reports(metrics)  # before verl averages them as numbers
        reduced = original(metrics, *args, **kwargs)
        if reports:
            trace_hook.after_update(reports, reduced)
        return reduced

    return reduce_metrics

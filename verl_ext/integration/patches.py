"""The plugin's wrappers of verl functions and its registration into verl's estimator registry.

Each function here is named by a record of :mod:`verl_ext.touches` (which says why and for which
verl versions) and applied by :mod:`verl_ext.patching` right after its verl module is imported.
Every wrapper delegates to the original for anything that is not verl-ext's business; what a training
step does is told in one place, :mod:`verl_ext.integration.step`. They import what they need when
applied (verl has torch loaded by then), so that loading the plugin stays light.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable

logger = logging.getLogger("verl_ext")


# --------------------------------------------------------------------------- advantages


def wrap_compute_advantage(original: Callable) -> Callable:
    from verl_ext.integration import step

    signature = inspect.signature(original)  # bind by name: the positional order differs across versions

    @functools.wraps(original)
    def compute_advantage(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        return step.advantage_step(call.arguments, lambda: original(*args, **kwargs))

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


# --------------------------------------------------------------------------- the training step (step.py)


def wrap_apply_kl_penalty(original: Callable) -> Callable:
    from verl_ext.integration import step

    @functools.wraps(original)
    def apply_kl_penalty(data, kl_ctrl, *args, **kwargs):
        # β read before the call: the adaptive controller updates itself inside
        with step.kl_applied(data, kl_ctrl.value):
            return original(data, kl_ctrl, *args, **kwargs)

    return apply_kl_penalty


def wrap_kl_penalty(original: Callable) -> Callable:
    from verl_ext.integration import step

    @functools.wraps(original)
    def kl_penalty(*args, **kwargs):
        kld = original(*args, **kwargs)
        step.kl_penalty_returned(kld)
        return kld

    return kl_penalty


def wrap_rollout_correction(original: Callable) -> Callable:
    from verl_ext.integration import step

    @functools.wraps(original)
    def compute_rollout_correction_and_add_to_batch(batch, *args, **kwargs):
        return step.rollout_corrected(batch, lambda: original(batch, *args, **kwargs))

    return compute_rollout_correction_and_add_to_batch


def _wrap_fit(original: Callable, trainer_kind: str, check: Callable[[Any], None] | None = None) -> Callable:
    """verl's ``fit`` inside verl-ext's run (:func:`step.fit_session`): a coroutine function stays one (the
    one-step-off and fully-async trainers' ``async def fit``). A ``fit`` reached from another one already in
    a run of the same trainer (a subclass's wrapped fit calling ``super().fit()``) is verl's alone."""
    from verl_ext.integration import loggers, step

    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def async_fit(self, *args, **kwargs):
            if step.current_run().trainer is self:
                return await original(self, *args, **kwargs)
            if check is not None:
                check(self)
            with loggers.finished_when_fit_ends(), step.fit_session(self, trainer_kind) as run:
                result = await original(self, *args, **kwargs)
                run.fit_returned()
                return result

        return async_fit

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        if step.current_run().trainer is self:
            return original(self, *args, **kwargs)
        if check is not None:
            check(self)
        # verl's loggers made in fit() are finished when it ends (verl_ext.integration.loggers: W&B lost the run)
        with loggers.finished_when_fit_ends(), step.fit_session(self, trainer_kind) as run:
            result = original(self, *args, **kwargs)
            # only once fit() returned after its last step: an error or an interrupt leaves the run
            # record saying the run did not finish
            run.fit_returned()
            return result

    return fit


def wrap_legacy_fit(original: Callable) -> Callable:
    """verl's ``RayPPOTrainer.fit``, and the fits of its experimental subclasses (separation, one-step-off,
    fully async: the same advantage step, on the same kind of batch)."""
    return _wrap_fit(original, "legacy")


def wrap_v1_fit(original: Callable) -> Callable:
    return _wrap_fit(original, "v1")


# --------------------------------------------------------------------------- trainers with their own fit


def register_legacy_trainer_check(ray_trainer: Any) -> None:
    """Every later subclass of ``RayPPOTrainer`` that brings its own ``fit`` checks its config when made."""
    from verl_ext.integration.trainer_modes import check_subclasses_of

    check_subclasses_of(ray_trainer.RayPPOTrainer)


def register_v1_trainer_check(trainer_base: Any) -> None:
    """As :func:`register_legacy_trainer_check`, for the V1 trainer's base ``PPOTrainer``."""
    from verl_ext.integration.trainer_modes import check_subclasses_of

    check_subclasses_of(trainer_base.PPOTrainer)


def wrap_v1_compute_advantage(original: Callable) -> Callable:
    from verl_ext.integration import step

    @functools.wraps(original)
    def _compute_advantage(self, batch, metrics):
        return step.v1_advantage_step(batch, metrics, lambda: original(self, batch, metrics))

    return _compute_advantage


def wrap_v1_multi_trajectory_advantage(original: Callable) -> Callable:
    from verl_ext.integration import step

    @functools.wraps(original)
    def compute_advantage_for_multi_trajectories(*args, **kwargs):
        data = original(*args, **kwargs)
        step.v1_batch_advantaged(data)
        return data

    return compute_advantage_for_multi_trajectories


# --------------------------------------------------------------------------- the live metrics


def wrap_compute_data_metrics(original: Callable) -> Callable:
    from verl_ext.integration import step

    @functools.wraps(original)
    def compute_data_metrics(*args, **kwargs):
        return {**original(*args, **kwargs), **step.take_metrics()}

    return compute_data_metrics


# --------------------------------------------------------------------------- V(s_L) for algorithm.truncation=bootstrap


def wrap_legacy_compute_values(original: Callable) -> Callable:
    from verl_ext.integration.values_after_last import legacy_values

    @functools.wraps(original)
    def _compute_values(self, batch):
        return legacy_values(original, self, batch)

    return _compute_values


def wrap_v1_compute_values(original: Callable) -> Callable:
    from verl_ext.integration.values_after_last import v1_values

    @functools.wraps(original)
    def _compute_values(self, batch, metrics):
        return v1_values(original, self, batch, metrics)

    return _compute_values


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


def wrap_train_mini_batch(original: Callable) -> Callable:
    from verl_ext.integration.update_hook import traced_train_mini_batch

    @functools.wraps(original)  # keeps verl's @register attributes, which the worker groups dispatch by
    def train_mini_batch(self, data):
        return traced_train_mini_batch(original, self, data)

    return train_mini_batch


def wrap_make_iterator(original: Callable) -> Callable:
    from verl_ext.integration.update_hook import tagged_make_iterator

    @functools.wraps(original)
    def make_iterator(tensordict, mini_batch_size, epochs, seed=None, dataloader_kwargs=None):
        return tagged_make_iterator(original, tensordict, mini_batch_size, epochs, seed, dataloader_kwargs)

    return make_iterator


def wrap_reduce_metrics(original: Callable) -> Callable:
    from verl_ext.integration import step

    @functools.wraps(original)
    def reduce_metrics(metrics: dict, *args, **kwargs):
        return step.reduce_update_metrics(metrics, lambda: original(metrics, *args, **kwargs))

    return reduce_metrics


def wrap_left_right_2_no_padding(original: Callable) -> Callable:
    from verl_ext.trace.batch_keys import LOSS_MASK_KEY

    @functools.wraps(original)
    def left_right_2_no_padding(data):
        loss_mask = data.pop(LOSS_MASK_KEY, None)  # only a batch verl-ext replay rebuilt from a V1 run carries it
        data = original(data)
        if loss_mask is not None:
            data["loss_mask"] = loss_mask
        return data

    return left_right_2_no_padding


def wrap_calculate_debug_metrics(original: Callable) -> Callable:
    from verl_ext.integration import step

    @functools.wraps(original)
    def calculate_debug_metrics(data):
        metrics = original(data)
        step.debug_metrics_computed(metrics)
        return metrics

    return calculate_debug_metrics

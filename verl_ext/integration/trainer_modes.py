"""Trainers whose loop verl-ext cannot follow: stopped before training when a run asks verl-ext for
what only its run inside ``fit`` serves.

verl-ext's run (:func:`verl_ext.integration.step.fit_session`) starts in a trainer's ``fit``: verl's own
(``RayPPOTrainer.fit``, the V1 ``PPOTrainer.fit``) and those of verl's experimental trainers, whose loops
verl-ext follows (separation, one-step-off-policy, fully async: their ``fit`` is wrapped as verl's is, a
record of :data:`verl_ext.touches.PLUGIN_TOUCHES` each; their steps reach the same advantage step and
update reduction). Every update of every mode is its own trace step (V1's ``parameter_sync_step`` updates
per step included: :mod:`verl_ext.integration.async_modes`).

A trainer that brings a ``fit`` of its own that verl-ext does not wrap (a subclass with its own loop; one
whose ``fit`` calls ``super().fit()`` reaches a wrapped one and is let through) never starts verl-ext's
run, so the trace, the update tables, the live metrics, ``verl_ext.turn_rewards`` and
``verl_ext.nonfinite=raise`` would all be ignored. (verl's fully-async rollouter is a trainer subclass whose
``fit`` only generates: :data:`GENERATION_ONLY`, let through.) It is stopped when the trace, turn rewards or
``nonfinite=raise`` are asked for, when the trainer is made: every subclass of verl's two trainer bases
made after verl-ext loaded has its constructor checked (:func:`check_subclasses_of`), which is the one
place all of them pass through before their first step. The live metrics alone (on by default) do not
stop it: installing verl-ext must not break a run that asked it for nothing; the run says once, in one
warning line, that they are not logged.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Mapping

from verl_ext.options import TraceOptions, metrics_enabled, nonfinite_mode, turn_rewards_enabled
from verl_ext.patching import ORIGINAL_ATTR

logger = logging.getLogger("verl_ext")

#: Set on a constructor that checks its trainer, so that a subclass inheriting it is not wrapped twice.
_CHECKED = "__verl_ext_checks_trainer__"

# --------------------------------------------------------------------------- trainers that bypass verl's fit


def options_fit_serves(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(what is asked for, how to give it up) for each verl-ext option only verl's ``fit`` serves."""
    asked = []
    if TraceOptions.from_config(config).enabled:
        asked.append(("the trace", "remove verl_ext.trace.dir"))
    if turn_rewards_enabled(config):
        asked.append(("verl_ext.turn_rewards", "set verl_ext.turn_rewards=false"))
    if nonfinite_mode(config) == "raise":  # outside fit() a non-finite value only warns
        asked.append(("verl_ext.nonfinite=raise", "set verl_ext.nonfinite=warn"))
    return asked


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


#: verl's subclasses of a trainer base whose ``fit`` generates and never trains (module, class): the fully-async
#: rollouter (a SeparateRayPPOTrainer for its resource pools and validation), whose samples the fully-async trainer's
#: fit, the one verl-ext follows, trains and traces.
GENERATION_ONLY = {("verl.experimental.fully_async_policy.fully_async_rollouter", "FullyAsyncRollouter")}


def own_fit_owner(trainer_class: type, base: type) -> type | None:
    """The class whose ``fit`` ``trainer_class`` runs instead of one verl-ext follows (``base``'s, or any
    ``fit`` verl-ext wrapped: verl's experimental trainers'); None when it runs one of those. A ``fit`` that
    calls ``super().fit()`` reaches the next one in the MRO, so an override that only adds around a
    followed loop is let through."""
    for owner in trainer_class.__mro__:
        fit = vars(owner).get("fit")
        if fit is None:
            continue
        if owner is base or fit is vars(base).get("fit") or followed(fit) or (owner.__module__, owner.__name__) in GENERATION_ONLY:
            return None
        if not _calls_super_fit(fit):
            return owner
    return None


def followed(fit: Any) -> bool:
    """``fit`` is verl-ext's wrapper of a trainer's loop (a touch of :mod:`verl_ext.touches`)."""
    return getattr(getattr(fit, "__func__", fit), ORIGINAL_ATTR, None) is not None


def _calls_super_fit(fit: Any) -> bool:
    code = getattr(inspect.unwrap(getattr(fit, "__func__", fit)), "__code__", None)
    return code is not None and {"super", "fit"} <= set(code.co_names)


def missing_metrics_warning(trainer_class: type, base: type, config: Mapping[str, Any]) -> str | None:
    """The one warning line of a run of ``trainer_class`` that will not log verl-ext's live metrics; None if it will."""
    owner = own_fit_owner(trainer_class, base)
    if owner is None or not metrics_enabled(config):
        return None
    return (
        f"verl-ext: {owner.__name__} ({owner.__module__}) runs its own fit(), which never reaches verl-ext's step: "
        "verl-ext's live metrics are not logged in this run (set verl_ext.metrics=false to silence this line)"
    )


def bypassed_fit_problem(trainer_class: type, base: type, config: Mapping[str, Any]) -> str | None:
    """Why ``trainer_class`` (a subclass of verl's trainer ``base``) must not start with ``config``; None if it may."""
    owner = own_fit_owner(trainer_class, base)
    asked = options_fit_serves(config) if owner is not None else []
    if not asked:
        return None
    return (
        f"verl-ext: {owner.__name__} ({owner.__module__}) runs its own fit(), which never reaches verl-ext's step, so "
        f"{_listed([what for what, _ in asked])} would be missing without a word: {_listed([fix for _, fix in asked])} to "
        f"run it without them, or use a trainer that runs {base.__name__}.fit (python -m verl.trainer.main_ppo)"
    )


def check_subclasses_of(base: type) -> None:
    """From now on, every subclass of ``base`` whose ``fit`` is its own checks the run's config when an
    instance is made (its constructor wrapped once, in the subclass); ``base``'s own ``fit`` is verl-ext's."""
    hook = vars(base).get("__init_subclass__")
    if hook is not None and getattr(hook.__func__, _CHECKED, False):
        return  # a second load of the plugin
    if hook is not None:
        raise RuntimeError(f"{base.__qualname__} defines __init_subclass__ itself: verl-ext would replace it")

    def __init_subclass__(cls, **kwargs):
        super(base, cls).__init_subclass__(**kwargs)
        constructor = cls.__init__
        if own_fit_owner(cls, base) is not None and not getattr(constructor, _CHECKED, False):
            cls.__init__ = _checking_constructor(constructor, base)

    setattr(__init_subclass__, _CHECKED, True)
    base.__init_subclass__ = classmethod(__init_subclass__)


def _checking_constructor(constructor: Any, base: type) -> Any:
    signature = inspect.signature(constructor)

    @functools.wraps(constructor)
    def __init__(self, *args, **kwargs):
        try:
            config = signature.bind_partial(self, *args, **kwargs).arguments.get("config")
        except TypeError:  # wrong arguments: the constructor itself says which
            config = None
        if config is not None:
            problem = bypassed_fit_problem(type(self), base, config)
            if problem:
                raise ValueError(problem)
            warning = missing_metrics_warning(type(self), base, config)
            if warning:
                logger.warning(warning)
        constructor(self, *args, **kwargs)

    setattr(__init__, _CHECKED, True)
    return __init__

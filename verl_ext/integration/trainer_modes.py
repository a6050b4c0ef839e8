"""Trainer modes in which verl-ext would lose what a run asked it to record: stopped before training.

Two ways a trainer drops verl-ext's work without a word:

* **Sub-steps.** A V1 trainer runs ``parameter_sync_step`` local updates per step (``PPOTrainer.step``:
  ``_step_once`` that many times, ``separate_async`` defaults to 4) under one ``global_steps``; the
  trace keeps one step per number, so all but the last would vanish. Stopped when the trace is on,
  with one line naming the mode and what to set. Tracing every sub-step would need a sub-step index
  in the trace's schema, its checker and its view; a run that is stopped loses nothing, so that is
  the choice here. The live metrics and the non-finite check run on every sub-step (verl combines the
  metrics over them, ``MetricsAggregator``), so they alone do not stop the run.
* **A trainer whose ``fit`` is not verl's patched one** (verl's separation, one-step-off-policy and
  fully-async trainers, and any future subclass that brings its own loop; one whose ``fit`` calls
  ``super().fit()`` reaches verl's and is let through): verl-ext's run
  (:func:`verl_ext.integration.step.fit_session`) never starts, so the trace, the update tables, the
  live metrics, ``verl_ext.turn_rewards`` and ``verl_ext.nonfinite=raise`` would all be ignored.
  Stopped when the trace, turn rewards or ``nonfinite=raise`` are asked for, when the trainer is made:
  every subclass of verl's two trainer bases made after verl-ext loaded has its constructor checked
  (:func:`check_subclasses_of`), which is the one place all of them pass through before their first
  step (they do not all call the base's ``__init__`` or ``init_workers``; ``fit`` comes after the
  workers and, for the fully-async trainer, after a validation). The live metrics alone (on by
  default) do not stop it: installing verl-ext must not break a run that asked it for nothing; the
  run says once, in one warning line, that they are not logged.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Mapping

from verl_ext.options import TraceOptions, metrics_enabled, nonfinite_mode, turn_rewards_enabled

logger = logging.getLogger("verl_ext")

#: Set on a constructor that checks its trainer, so that a subclass inheriting it is not wrapped twice.
_CHECKED = "__verl_ext_checks_trainer__"

# --------------------------------------------------------------------------- sub-steps (V1)


def v1_sub_steps(config: Mapping[str, Any]) -> tuple[str, int]:
    """(trainer mode, local updates per step) of a V1 run, read as verl's ``PPOTrainer.__init__`` reads them."""
    v1 = config["trainer"]["v1"]
    mode = v1["trainer_mode"]
    return mode, int((v1.get(mode) or {}).get("parameter_sync_step", 1))


def sub_step_problem(mode: str, sub_steps: int, config: Mapping[str, Any]) -> str | None:
    """Why a traced V1 run in ``mode`` with ``sub_steps`` updates per step would lose most of its trace; None if it would not."""
    if sub_steps <= 1 or not TraceOptions.from_config(config).enabled:
        return None
    # separate_async asserts train_batch_size == parameter_sync_step * ppo_mini_batch_size (verl's trainer_separate_async.py)
    also = " (with actor_rollout_ref.actor.ppo_mini_batch_size=data.train_batch_size)" if mode == "separate_async" else ""
    return (
        f"verl-ext: trainer.v1.trainer_mode={mode} runs {sub_steps} updates per step under one step number "
        f"(trainer.v1.{mode}.parameter_sync_step={sub_steps}) and the trace keeps one per step, so {sub_steps - 1} of "
        f"every {sub_steps} would be missing from it: set trainer.v1.{mode}.parameter_sync_step=1{also} "
        "or turn the trace off (remove verl_ext.trace.dir)"
    )


def check_v1_config(config: Mapping[str, Any]) -> None:
    """On the driver, before Ray starts: ValueError when a V1 run's trace would lose its sub-steps."""
    trainer = config.get("trainer") or {}
    if not trainer.get("use_v1", False) or "v1" not in trainer:
        return
    problem = sub_step_problem(*v1_sub_steps(config), config)
    if problem:
        raise ValueError(problem)


def check_v1_trainer(trainer: Any) -> None:
    """At the V1 trainer's ``fit``, before its first step, with the updates per step it will run."""
    sub_steps = int(getattr(trainer, "parameter_sync_step", 1))  # what PPOTrainer.__init__ read from the config
    problem = sub_step_problem(getattr(trainer, "trainer_mode", "?"), sub_steps, trainer.config)
    if problem:
        raise ValueError(problem)


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


def own_fit_owner(trainer_class: type, base: type) -> type | None:
    """The class whose ``fit`` ``trainer_class`` runs instead of ``base``'s (verl-ext's patched one); None
    when it runs ``base``'s. A ``fit`` that calls ``super().fit()`` reaches the next one in the MRO, so an
    override that only adds around verl's loop is let through."""
    for owner in trainer_class.__mro__:
        fit = vars(owner).get("fit")
        if fit is None:
            continue
        if owner is base or fit is vars(base).get("fit"):
            return None
        if not _calls_super_fit(fit):
            return owner
    return None


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

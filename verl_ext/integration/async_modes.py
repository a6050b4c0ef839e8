"""How verl's trainer overlapped generation and training (the run record's ``mode``), where each of its
updates sits (its trace step, verl's own step and sub-step, the trainer's version) and the policy
versions verl tagged each response with: what the trace records of an asynchronous run
(docs/definitions.md#policy-versions).

verl 0.9.1 numbers the weights it sends to the rollout: each sync passes a number (``global_steps``), the
rollout server tags every output with the number of the weights that produced it, and verl's client
keeps the first and the last part's number of a response (``min_global_steps``, ``max_global_steps``: a
partial rollout resumed after a sync spans two). The trace keeps these numbers as verl wrote them, and
per update the number of the last weights verl sent to the rollout before it (``trainer_version``):

========================  ====================  ===========================  =========================
mode                      trace step            verl's sync after            trainer_version
========================  ====================  ===========================  =========================
sync (legacy, V1)         verl's step n         step n's update, as n        n − 1
V1 separate_async         (n − 1)·K + j + 1     step n's K updates, as n     n − 1
one_step_off              verl's step n         before step n's update, n    n
fully_async               verl's step u         every T updates, as c + 1    c (current_param_version)
========================  ====================  ===========================  =========================

(K: ``parameter_sync_step``, j = 0 … K − 1 the update within step n: ``substep``; T:
``trigger_parameter_sync_step``, whose updates of one version are substeps 0 … T − 1 where T > 1; one update
per step in the other modes.) A response's staleness,
``trainer_version − policy_version_min``, is then the number of syncs between the weights that wrote its
first token and the weights the update starts from in every mode; one-step-off labels the initial weights
twice (syncs 0 and 1), so its staleness is 1 at every step, step 1 included, where both are the same weights.

Pure functions of verl's trainer objects and config (duck-typed: nothing of verl is imported here).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

#: The run record's mode names (RunRecord.mode["name"]): verl's V1 trainer modes and its two experimental trainers.
SYNC, SEPARATE_ASYNC, COLOCATE_ASYNC, ONE_STEP_OFF, FULLY_ASYNC = "sync", "separate_async", "colocate_async", "one_step_off", "fully_async"

#: verl's experimental trainers, by (module, class): the modes whose loop runs on a legacy-family batch.
_EXPERIMENTAL = {
    ("verl.experimental.one_step_off_policy.ray_trainer", "OneStepOffRayTrainer"): ONE_STEP_OFF,
    ("verl.experimental.fully_async_policy.fully_async_trainer", "FullyAsyncTrainer"): FULLY_ASYNC,
}


def experimental_mode(trainer_class: type) -> str | None:
    """ONE_STEP_OFF or FULLY_ASYNC for one of verl's experimental trainers or a subclass of one; None otherwise."""
    for klass in trainer_class.__mro__:
        mode = _EXPERIMENTAL.get((klass.__module__, klass.__qualname__))
        if mode is not None:
            return mode
    return None


def run_mode(config: Any, trainer: Any, kind: str) -> dict[str, Any]:
    """The run record's ``mode``: {"name", and the mode's settings as verl read them}. ``kind``: "legacy"
    (verl's RayPPOTrainer and the experimental trainers built on it) or "v1"."""
    if kind == "v1":
        name = str(getattr(trainer, "trainer_mode", None) or config["trainer"]["v1"]["trainer_mode"])
        if name == SYNC:
            return {"name": SYNC}
        sampler = config["trainer"]["v1"].get("sampler") or {}
        threshold = sampler.get("max_off_policy_threshold")
        return {
            "name": name,
            "parameter_sync_step": int(getattr(trainer, "parameter_sync_step", 1)),
            "max_off_policy_threshold": None if threshold is None else int(threshold),
            "max_off_policy_strategy": None if sampler.get("max_off_policy_strategy") is None else str(sampler.get("max_off_policy_strategy")),
        }
    name = experimental_mode(type(trainer)) if trainer is not None else None
    if name == FULLY_ASYNC:
        async_training = config["async_training"]
        threshold = float(async_training.get("staleness_threshold", 1))
        trigger = int(async_training.get("trigger_parameter_sync_step", 1))
        require_batches = int(async_training.get("require_batches", 1))
        required = int(config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"]) * require_batches
        return {
            "name": FULLY_ASYNC,
            "staleness_threshold": threshold,
            "trigger_parameter_sync_step": trigger,
            "require_batches": require_batches,
            "partial_rollout": bool(async_training.get("partial_rollout", True)),
            # the rollouter's own numbers (FullyAsyncRollouter.set_max_required_samples): prompts per update,
            # and the most prompts it starts between two syncs, those not yet trained at a sync included
            "required_samples": required,
            "max_required_samples": int(required * (threshold + 1) * trigger),
        }
    if name == ONE_STEP_OFF:
        return {"name": ONE_STEP_OFF}
    return {"name": SYNC}


@dataclass(frozen=True)
class UpdatePosition:
    """Where one update of verl's trainer sits: the trace's step, verl's own step, the update's place among
    those that share one weight sync (``substep``, 0-based: V1's parameter_sync_step updates of one step,
    fully async's trigger_parameter_sync_step updates of one version; None where every update is followed by
    a sync), and the number of the last weights verl sent to the rollout before it (module docstring).
    π_θ at the update's start is those weights after ``substep`` more local updates."""

    trace_step: int
    global_step: int
    substep: int | None
    trainer_version: int | None


def position(trainer: Any, kind: str, mode: Mapping[str, Any] | None) -> UpdatePosition | None:
    """The position of the update ``trainer`` is in (None outside a run: no trainer or no step yet)."""
    steps = getattr(trainer, "global_steps", None)
    if steps is None:
        return None
    step = int(steps)
    name = (mode or {}).get("name", SYNC)
    if kind == "v1":
        updates = int(getattr(trainer, "parameter_sync_step", 1) or 1)
        if updates > 1:
            substep = int(getattr(trainer, "local_trigger_step", 0) or 0)
            return UpdatePosition((step - 1) * updates + substep + 1, step, substep, step - 1)
        return UpdatePosition(step, step, None, step - 1)
    if name == ONE_STEP_OFF:
        return UpdatePosition(step, step, None, step)
    if name == FULLY_ASYNC:
        version = getattr(trainer, "current_param_version", None)
        updates = int((mode or {}).get("trigger_parameter_sync_step", 1) or 1)
        substep = int(getattr(trainer, "local_trigger_step", 1)) - 1 if updates > 1 else None  # verl counts from 1
        return UpdatePosition(step, step, substep, None if version is None else int(version))
    return UpdatePosition(step, step, None, step - 1)


def traced_verl_step(trainer: Any) -> int | None:
    """verl's own step, whose updates ``verl_ext.trace.every`` selects (all of a step's updates or none)."""
    steps = getattr(trainer, "global_steps", None)
    return None if steps is None else int(steps)


def planned_updates(mode: Mapping[str, Any] | None, trainer: Any, planned_steps: int | None) -> int | None:
    """The trace steps a run plans: verl's planned steps, × parameter_sync_step in V1's modes with several
    updates per step; a fully-async trainer's planned weight versions × trigger_parameter_sync_step."""
    name = (mode or {}).get("name")
    if name == FULLY_ASYNC:
        versions = getattr(trainer, "total_train_steps", None)
        return None if versions is None else int(versions) * int(mode["trigger_parameter_sync_step"])
    updates = (mode or {}).get("parameter_sync_step")
    if planned_steps is None or not updates:
        return planned_steps
    return planned_steps * int(updates)


# --------------------------------------------------------------------------- the responses' versions


def _version(value: Any) -> int | None:
    """A version as verl tagged it: an int (numpy's too); None where it said none (None, NaN, negative)."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if number == number and number >= 0 else None


def legacy_versions(non_tensor_batch: Mapping[str, Any]) -> list[tuple[int | None, int | None]] | None:
    """(min, max) per response from a legacy-family batch (the agent loop's ``min_global_steps`` and
    ``max_global_steps``, object arrays); None where the batch has neither."""
    low, high = non_tensor_batch.get("min_global_steps"), non_tensor_batch.get("max_global_steps")
    if low is None and high is None:
        return None
    size = len(low if low is not None else high)
    low = [None] * size if low is None else list(low)
    high = [None] * size if high is None else list(high)
    return [(_version(a), _version(b)) for a, b in zip(low, high, strict=True)]


def v1_versions(tags: Sequence[Mapping[str, Any]] | None) -> list[tuple[int | None, int | None]] | None:
    """(min, max) per sample from the V1 trainer's TransferQueue tags (agent_loop_tq.py: ``min_global_steps``,
    ``max_global_steps``; a padding sample has none)."""
    if tags is None:
        return None
    return [(_version(tag.get("min_global_steps")), _version(tag.get("max_global_steps"))) for tag in tags]


#: verl's fully-async counts of an update that the trace's rows rebuild (check's async_logged): the trainer's
#: step metrics hold them when the advantage step runs (FullyAsyncTrainer._collect_metrics_from_samples, detach_utils).
FULLY_ASYNC_LOGGED = (
    "fully_async/count/stale_trajectory_processed",
    "fully_async/count/current_param_version",
    "fully_async/partial/total_partial_num",
    "fully_async/partial/partial_ratio",
    "fully_async/partial/max_partial_span",
)


def logged_counts(trainer: Any, mode: Mapping[str, Any] | None) -> dict[str, float]:
    """The fully-async counts verl computed for the update in progress (``trainer.metrics``); {} in another mode."""
    if (mode or {}).get("name") != FULLY_ASYNC:
        return {}
    metrics = getattr(trainer, "metrics", None) or {}
    return {key: float(metrics[key]) for key in FULLY_ASYNC_LOGGED if isinstance(metrics.get(key), numbers.Real)}

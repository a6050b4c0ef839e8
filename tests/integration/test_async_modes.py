"""Where each update of verl's trainers sits in the trace (verl_ext.integration.async_modes), without training:
the trace step, verl's step and sub-step and the trainer's version of each mode's updates, written out by hand
from verl's loops (V1's PPOTrainer.step runs parameter_sync_step local updates, then syncs as the step's number;
one-step-off syncs as step n before step n's update; fully async syncs every trigger_parameter_sync_step updates
as current_param_version); the run record's mode from verl's config; the versions verl tags its batches with; and
verl-ext's wrapper of an ``async def fit`` (the one-step-off and fully-async trainers').

Covers: verl_ext.integration.async_modes, patches._wrap_fit, step.Run's positions.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf

from verl_ext.integration import async_modes
from verl_ext.integration.async_modes import UpdatePosition


def v1_trainer(step: int, local: int, updates: int, mode: str = "separate_async"):
    return SimpleNamespace(global_steps=step, local_trigger_step=local, parameter_sync_step=updates, trainer_mode=mode)


def test_v1_sub_steps_are_numbered_one_trace_step_each_in_order():
    """parameter_sync_step = 3: verl's steps 1 and 2 are trace steps 1-3 and 4-6; every update of verl's step n starts
    from the weights synced after step n − 1 (number n − 1)."""
    mode = {"name": "separate_async", "parameter_sync_step": 3}
    seen = [async_modes.position(v1_trainer(step, local, 3), "v1", mode) for step in (1, 2) for local in range(3)]
    assert seen == [
        UpdatePosition(1, 1, 0, 0), UpdatePosition(2, 1, 1, 0), UpdatePosition(3, 1, 2, 0),
        UpdatePosition(4, 2, 0, 1), UpdatePosition(5, 2, 1, 1), UpdatePosition(6, 2, 2, 1),
    ]  # fmt: skip
    # one update per step (V1 sync, or separate_async with parameter_sync_step=1): the trace's step is verl's, no sub-step
    assert async_modes.position(v1_trainer(5, 0, 1, "sync"), "v1", {"name": "sync"}) == UpdatePosition(5, 5, None, 4)


def test_the_legacy_family_numbers_by_verls_step_and_its_sync_labels():
    one_step = SimpleNamespace(global_steps=4)
    assert async_modes.position(one_step, "legacy", {"name": "sync"}) == UpdatePosition(4, 4, None, 3)
    assert async_modes.position(one_step, "legacy", {"name": "one_step_off"}) == UpdatePosition(4, 4, None, 4)
    fully = {"name": "fully_async", "trigger_parameter_sync_step": 1}
    assert async_modes.position(SimpleNamespace(global_steps=7, current_param_version=6, local_trigger_step=1), "legacy", fully) == UpdatePosition(7, 7, None, 6)
    # two updates per version: verl counts them 1, 2 (local_trigger_step); the trace 0, 1
    fully = {"name": "fully_async", "trigger_parameter_sync_step": 2}
    assert async_modes.position(SimpleNamespace(global_steps=4, current_param_version=1, local_trigger_step=2), "legacy", fully) == UpdatePosition(4, 4, 1, 1)
    assert async_modes.position(SimpleNamespace(global_steps=None), "legacy", fully) is None


def test_the_run_records_mode_says_verls_settings():
    config = OmegaConf.create({
        "async_training": {"staleness_threshold": 0.1, "trigger_parameter_sync_step": 1, "require_batches": 1, "partial_rollout": True},
        "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}},
    })  # fmt: skip

    class FullyAsyncTrainer:  # verl's name and module, as a subclass made by Ray keeps them
        pass

    FullyAsyncTrainer.__module__ = "verl.experimental.fully_async_policy.fully_async_trainer"
    FullyAsyncTrainer.__qualname__ = "FullyAsyncTrainer"

    class RaysSubclass(FullyAsyncTrainer):
        pass

    mode = async_modes.run_mode(config, RaysSubclass(), "legacy")
    # FullyAsyncRollouter.set_max_required_samples: int(4 · (0.1 + 1) · 1) = int(4.4) = 4
    assert mode == {
        "name": "fully_async", "staleness_threshold": 0.1, "trigger_parameter_sync_step": 1, "require_batches": 1,
        "partial_rollout": True, "required_samples": 4, "max_required_samples": 4,
    }  # fmt: skip
    v1 = OmegaConf.create({"trainer": {"v1": {"trainer_mode": "separate_async", "sampler": {"max_off_policy_threshold": 8, "max_off_policy_strategy": "drop"}}}})
    assert async_modes.run_mode(v1, v1_trainer(1, 0, 2), "v1") == {
        "name": "separate_async", "parameter_sync_step": 2, "max_off_policy_threshold": 8, "max_off_policy_strategy": "drop",
    }  # fmt: skip
    assert async_modes.run_mode(v1, v1_trainer(1, 0, 1, "sync"), "v1") == {"name": "sync"}
    assert async_modes.run_mode(config, object(), "legacy") == {"name": "sync"}
    # planned trace steps: one per update
    assert async_modes.planned_updates({"name": "separate_async", "parameter_sync_step": 2}, None, 5) == 10
    assert async_modes.planned_updates(mode, SimpleNamespace(total_train_steps=3), None) == 3
    assert async_modes.planned_updates({"name": "sync"}, None, 5) == 5


def test_the_versions_verl_tags_its_batches_with():
    """The agent loop's object arrays (None where a server said nothing), V1's TransferQueue tags (a padding sample has none)."""
    batch = {"min_global_steps": np.array([0, np.int64(2), None], dtype=object), "max_global_steps": np.array([1, 2, None], dtype=object)}
    assert async_modes.legacy_versions(batch) == [(0, 1), (2, 2), (None, None)]
    assert async_modes.legacy_versions({}) is None
    tags = [{"min_global_steps": 3, "max_global_steps": 4}, {"is_padding": True}]
    assert async_modes.v1_versions(tags) == [(3, 4), (None, None)]


def test_verls_fully_async_counts_are_taken_from_the_update_in_progress():
    metrics = {"fully_async/count/stale_trajectory_processed": np.int64(3), "fully_async/partial/partial_ratio": 0.25,
               "fully_async/total_wait_time": 1.5, "training/global_step": 2}  # fmt: skip
    trainer = SimpleNamespace(metrics=metrics)
    assert async_modes.logged_counts(trainer, {"name": "fully_async"}) == {
        "fully_async/count/stale_trajectory_processed": 3.0, "fully_async/partial/partial_ratio": 0.25,
    }  # fmt: skip
    assert async_modes.logged_counts(trainer, {"name": "one_step_off"}) == {}


class _Trainer:
    def __init__(self):
        self.config = OmegaConf.create({"algorithm": {}, "verl_ext": {"metrics": False}})
        self.global_steps = 3


def test_an_async_fit_runs_inside_verl_exts_run_and_stays_a_coroutine_function():
    """The one-step-off and fully-async trainers' fit is ``async def``: the wrapper is too, the run is current while it
    awaits, and a fit reached from inside it (a subclass calling super().fit()) opens no second run."""
    import inspect

    from verl_ext.integration import patches, step

    seen = []

    async def verls_fit(self):
        seen.append((step.current_run().trainer is self, step.current_run().trace_step()))
        await asyncio.sleep(0)
        return "done"

    fit = patches.wrap_legacy_fit(verls_fit)
    assert inspect.iscoroutinefunction(fit)
    trainer = _Trainer()
    assert asyncio.run(fit(trainer)) == "done"
    assert seen == [(True, 3)] and step.current_run().trainer is None

    async def outer(self):
        return await fit(self)  # the inner fit inside the outer's run: verl's alone

    assert asyncio.run(patches.wrap_legacy_fit(outer)(trainer)) == "done"
    assert seen[-1] == (True, 3)


@pytest.mark.parametrize("kind", ["legacy", "v1"])
def test_the_run_numbers_its_updates_by_the_mode(kind):
    from verl_ext.integration.step import Run

    trainer = v1_trainer(2, 1, 2)
    mode = async_modes.run_mode(OmegaConf.create({"trainer": {"v1": {"trainer_mode": "separate_async", "sampler": {}}}}), trainer, kind)
    run = Run(trainer, kind, mode=mode)
    assert run.global_step() == 2  # verl's: what verl_ext.trace.every selects
    assert run.trace_step() == (4 if kind == "v1" else 2)

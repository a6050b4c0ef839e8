"""No trainer mode loses verl-ext's work in silence: the decision at start-up, on verl's real trainer classes.

V1 ``separate_async`` runs ``parameter_sync_step`` updates per step under one step number: each is its own
trace step now (verl_ext.integration.async_modes), so a traced run starts. verl's separation, one-step-off-policy
and fully-async trainers run their own ``fit``, which verl-ext wraps as it wraps verl's (their steps reach the
same advantage step): made with the trace, they start, with no warning. A trainer with a ``fit`` of its own that
verl-ext does not follow (a subclass of any of them, or of verl's bases) still stops when made, in one line. No
trainer runs here: the tests stop at the decision (the real runs: tests/e2e/test_async_trace.py and, by hand,
docs/cpu_backend.md).
"""

from __future__ import annotations

import copy
import functools

import pytest

from tests.integration.conftest import requires_verl
from verl_ext.cpu import overrides


@functools.lru_cache(maxsize=None)
def _composed(overrides_: tuple[str, ...]):
    return overrides.compose_config(list(overrides_))


def compose_config(overrides_: list[str]):
    """verl's ppo_trainer.yaml with ``overrides_``, composed once per distinct list (a trainer may change its copy)."""
    return copy.deepcopy(_composed(tuple(overrides_)))

SEPARATE_ASYNC = (
    "trainer.v1.trainer_mode=separate_async",
    # what PPOTrainerSeparateAsync.__init__ asserts of a separate-async run
    "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
    "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
)  # fmt: skip


def own_fit_line(trainer: str, module: str, asked: str, fixes: str, base: str = "RayPPOTrainer") -> str:
    return (
        f"verl-ext: {trainer} ({module}) runs its own fit(), which never reaches verl-ext's step, so {asked} would be "
        f"missing without a word: {fixes} to run it without them, or use a trainer that runs {base}.fit "
        "(python -m verl.trainer.main_ppo)"
    )


# --------------------------------------------------------------------------- V1 separate_async: sub-steps


@requires_verl("0.9.0", "no V1 trainer")
@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param((), id="separate_async-4-updates"),  # verl's default parameter_sync_step (ppo_trainer.yaml:262)
        pytest.param(("trainer.v1.trainer_mode=colocate_async", "+trainer.v1.colocate_async.parameter_sync_step=2"), id="colocate_async-2-updates"),
        pytest.param(("actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.v1.separate_async.parameter_sync_step=1"), id="one-update-per-step"),
    ],
)  # fmt: skip
def test_a_traced_v1_run_with_several_updates_per_step_starts(tmp_path, overrides):
    """Issue 58: each update is its own trace step; verl-ext's check on the driver (inside verl's validate_config)
    lets it through (it refused it before)."""
    from verl_ext.integration.validation import check_config

    check_config(compose_config([*SEPARATE_ASYNC, *overrides, f"+verl_ext.trace.dir={tmp_path / 'trace'}"]))


@requires_verl("0.9.0", "no V1 trainer")
def test_a_separate_async_trainer_made_by_hand_is_made_with_the_trace_on(tmp_path, caplog):
    from verl.trainer.ppo.v1 import get_trainer_cls

    with caplog.at_level("WARNING", logger="verl_ext"):
        trainer = get_trainer_cls("separate_async")(compose_config([*SEPARATE_ASYNC, f"+verl_ext.trace.dir={tmp_path / 'trace'}"]))
    assert trainer.parameter_sync_step == 4
    assert not [r for r in caplog.records if r.name == "verl_ext"]


# --------------------------------------------------------------------------- trainers that run their own fit


def experimental_trainers():
    """verl's three trainers with their own fit, as each run makes it (Ray builds the fully-async trainer
    as an actor from the subclass ``ray.remote`` made of it)."""
    from verl.experimental.fully_async_policy.fully_async_trainer import FullyAsyncTrainer
    from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer
    from verl.experimental.separation.ray_trainer import SeparateRayPPOTrainer

    return {
        "separation": (SeparateRayPPOTrainer, "SeparateRayPPOTrainer", "verl.experimental.separation.ray_trainer"),
        "one-step-off-policy": (OneStepOffRayTrainer, "OneStepOffRayTrainer", "verl.experimental.one_step_off_policy.ray_trainer"),
        "fully-async": (
            FullyAsyncTrainer.__ray_metadata__.modified_class, "FullyAsyncTrainer",
            "verl.experimental.fully_async_policy.fully_async_trainer",
        ),
    }  # fmt: skip


MODES = ["separation", "one-step-off-policy", "fully-async"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("traced", [False, True], ids=["defaults", "everything-asked"])
def test_verls_experimental_trainers_are_followed_and_made_without_a_word(tmp_path, mode, traced, caplog):
    """Issue 58: their fit is verl-ext's wrapper (a touch each), so neither the trace nor anything else stops
    them and no line says the live metrics are missing: verl's own constructor runs (and, given no workers
    here, fails on its own terms: an error that is not verl-ext's line)."""
    from verl_ext.integration.trainer_modes import followed

    trainer_class, _, _ = experimental_trainers()[mode]
    assert followed(trainer_class.fit)
    asked = [f"+verl_ext.trace.dir={tmp_path / 'trace'}", "+verl_ext.turn_rewards=true", "+verl_ext.nonfinite=raise"] if traced else []
    with caplog.at_level("WARNING", logger="verl_ext"), pytest.raises(Exception) as failed:
        trainer_class(compose_config(asked), None, {}, None)
    assert not str(failed.value).startswith("verl-ext:")
    assert not [r.getMessage() for r in caplog.records if r.name == "verl_ext"]
    assert not (tmp_path / "trace").exists()


def test_the_fully_async_rollouter_which_only_generates_is_made_with_the_trace_on(tmp_path, caplog):
    """verl's FullyAsyncRollouter is a SeparateRayPPOTrainer whose fit generates and never trains: the trainer
    actor's fit traces the run, so the rollouter is neither stopped nor warned about (it was stopped before)."""
    from verl.experimental.fully_async_policy.fully_async_rollouter import FullyAsyncRollouter

    config = compose_config([f"+verl_ext.trace.dir={tmp_path / 'trace'}"])
    with caplog.at_level("WARNING", logger="verl_ext"), pytest.raises(Exception) as failed:
        FullyAsyncRollouter.__ray_metadata__.modified_class(config, None)
    assert not str(failed.value).startswith("verl-ext:")
    assert not [r for r in caplog.records if r.name == "verl_ext"]


@pytest.mark.parametrize("mode", MODES)
def test_a_subclass_of_an_experimental_trainer_with_a_loop_of_its_own_still_stops(tmp_path, mode, caplog):
    """The refusal remains for a trainer whose loop verl-ext cannot follow: a made-up subclass of each of verl's
    experimental trainers with a fit of its own stops when made (one line), says once that the live metrics are
    missing when nothing else is asked, and one whose fit calls super().fit() is let through."""
    trainer_class, _, _ = experimental_trainers()[mode]

    class OwnAsyncLoop(trainer_class):
        def __init__(self, config):
            self.config = config

        async def fit(self):
            return "own loop"

    class AroundTheirFit(trainer_class):
        def __init__(self, config):
            self.config = config

        async def fit(self):
            return await super().fit()

    config = compose_config([f"+verl_ext.trace.dir={tmp_path / 'trace'}", "+verl_ext.nonfinite=raise"])
    with pytest.raises(ValueError) as stopped:
        OwnAsyncLoop(config)
    assert str(stopped.value) == own_fit_line(
        "OwnAsyncLoop", __name__, "the trace and verl_ext.nonfinite=raise", "remove verl_ext.trace.dir and set verl_ext.nonfinite=warn"
    )
    assert AroundTheirFit(config).config is config
    with caplog.at_level("WARNING", logger="verl_ext"):
        OwnAsyncLoop(compose_config([]))
    assert [r.getMessage() for r in caplog.records if r.name == "verl_ext"] == [
        f"verl-ext: OwnAsyncLoop ({__name__}) runs its own fit(), which never reaches verl-ext's step: verl-ext's live "
        "metrics are not logged in this run (set verl_ext.metrics=false to silence this line)"
    ]


def test_any_later_subclass_with_its_own_fit_is_caught_and_one_that_extends_verl_fit_is_not(tmp_path):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    class OwnLoop(RayPPOTrainer):
        def __init__(self, config):
            self.config = config

        def fit(self):
            return "own loop"

    class Inherits(OwnLoop):  # no fit of its own: still OwnLoop's
        pass

    class AroundVerlFit(RayPPOTrainer):
        def __init__(self, config):
            self.config = config

        def fit(self):
            return super().fit()

    config = compose_config([f"+verl_ext.trace.dir={tmp_path / 'trace'}"])
    for trainer_class in (OwnLoop, Inherits):
        with pytest.raises(ValueError) as stopped:
            trainer_class(config)
        assert str(stopped.value) == own_fit_line("OwnLoop", __name__, "the trace", "remove verl_ext.trace.dir")
    assert AroundVerlFit(config).config is config


@requires_verl("0.9.0", "no V1 trainer")
def test_a_v1_trainer_with_its_own_fit_is_caught_and_verl_v1_trainers_are_not(tmp_path):
    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls

    class OwnV1Loop(PPOTrainerSync):
        def fit(self, agent_loop_manager):
            return "own loop"

    traced = [f"+verl_ext.trace.dir={tmp_path / 'trace'}", "+verl_ext.turn_rewards=true"]
    with pytest.raises(ValueError) as stopped:
        OwnV1Loop(compose_config(traced))
    assert str(stopped.value) == own_fit_line(
        "OwnV1Loop", __name__, "the trace and verl_ext.turn_rewards",
        "remove verl_ext.trace.dir and set verl_ext.turn_rewards=false", base="PPOTrainer",
    )
    assert get_trainer_cls("sync")(compose_config(traced)).trainer_mode == "sync"
    assert get_trainer_cls("colocate_async")(compose_config(["trainer.v1.trainer_mode=colocate_async", *traced])).parameter_sync_step == 1

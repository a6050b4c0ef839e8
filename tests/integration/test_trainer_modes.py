"""No trainer mode loses verl-ext's work in silence: the decision at start-up, on verl's real trainer classes.

V1 ``separate_async`` runs ``parameter_sync_step`` updates per step under one step number; a traced run
stops on the driver (verl's ``validate_config``) and, for a trainer made by hand, at ``fit``. verl's
separation, one-step-off-policy and fully-async trainers run their own ``fit``; with a verl-ext option
only verl's ``fit`` serves they stop when made, before any worker. No trainer runs here: each of these
modes needs GPUs (NCCL weight sync, separate rollout pools), so the tests stop at the decision.
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

SUB_STEPS_LINE = (
    "verl-ext: trainer.v1.trainer_mode=separate_async runs 4 updates per step under one step number "
    "(trainer.v1.separate_async.parameter_sync_step=4) and the trace keeps one per step, so 3 of every 4 would be "
    "missing from it: set trainer.v1.separate_async.parameter_sync_step=1 (with "
    "actor_rollout_ref.actor.ppo_mini_batch_size=data.train_batch_size) or turn the trace off (remove verl_ext.trace.dir)"
)


def own_fit_line(trainer: str, module: str, asked: str, fixes: str, base: str = "RayPPOTrainer") -> str:
    return (
        f"verl-ext: {trainer} ({module}) runs its own fit(), which never reaches verl-ext's step, so {asked} would be "
        f"missing without a word: {fixes} to run it without them, or use a trainer that runs {base}.fit "
        "(python -m verl.trainer.main_ppo)"
    )


def validate_on_driver(config) -> None:
    """What ``python -m verl.trainer.main_ppo`` does before Ray starts (main_ppo.py:177)."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))


# --------------------------------------------------------------------------- V1 separate_async: sub-steps


@requires_verl("0.9.0", "no V1 trainer")
def test_a_traced_separate_async_run_stops_on_the_driver_with_one_line(tmp_path):
    config = compose_config([*SEPARATE_ASYNC, f"+verl_ext.trace.dir={tmp_path / 'trace'}"])
    assert config.trainer.v1.separate_async.parameter_sync_step == 4  # verl's default (ppo_trainer.yaml:262)
    with pytest.raises(ValueError) as stopped:
        validate_on_driver(config)
    assert str(stopped.value) == SUB_STEPS_LINE
    assert not (tmp_path / "trace").exists()


@requires_verl("0.9.0", "no V1 trainer")
def test_a_separate_async_trainer_made_by_hand_stops_at_fit_before_its_first_step(tmp_path):
    from verl.trainer.ppo.v1 import get_trainer_cls

    trainer = get_trainer_cls("separate_async")(compose_config([*SEPARATE_ASYNC, f"+verl_ext.trace.dir={tmp_path / 'trace'}"]))
    assert trainer.parameter_sync_step == 4
    with pytest.raises(ValueError) as stopped:
        trainer.fit(agent_loop_manager=None)  # verl's fit would fail at once on None: the check comes first
    assert str(stopped.value) == SUB_STEPS_LINE
    assert not hasattr(trainer, "agent_loop_manager")  # verl's fit never started


@requires_verl("0.9.0", "no V1 trainer")
@pytest.mark.parametrize(
    ("overrides", "traced"),
    [
        pytest.param(("actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.v1.separate_async.parameter_sync_step=1"), True, id="one-update-per-step"),
        pytest.param((), False, id="trace-off"),  # the live metrics and the non-finite check see every sub-step
    ],
)  # fmt: skip
def test_separate_async_starts_when_the_trace_loses_nothing(tmp_path, overrides, traced):
    from verl_ext.integration.validation import check_config

    trace = [f"+verl_ext.trace.dir={tmp_path / 'trace'}"] if traced else []
    check_config(compose_config([*SEPARATE_ASYNC, *overrides, *trace]))


@requires_verl("0.9.0", "no V1 trainer")
def test_any_v1_mode_with_several_updates_per_step_stops_when_traced(tmp_path):
    """verl's PPOTrainer reads parameter_sync_step under whatever mode is chosen (trainer_base.py:130)."""
    from verl_ext.integration.validation import check_config

    trace = f"+verl_ext.trace.dir={tmp_path / 'trace'}"
    check_config(compose_config(["trainer.v1.trainer_mode=colocate_async", trace]))
    with pytest.raises(ValueError) as stopped:
        check_config(compose_config(["trainer.v1.trainer_mode=colocate_async", "+trainer.v1.colocate_async.parameter_sync_step=2", trace]))
    assert str(stopped.value) == (
        "verl-ext: trainer.v1.trainer_mode=colocate_async runs 2 updates per step under one step number "
        "(trainer.v1.colocate_async.parameter_sync_step=2) and the trace keeps one per step, so 1 of every 2 would be "
        "missing from it: set trainer.v1.colocate_async.parameter_sync_step=1 or turn the trace off (remove verl_ext.trace.dir)"
    )
    # the legacy trainer has no sub-steps, whatever trainer.v1 says
    check_config(compose_config([*SEPARATE_ASYNC, "trainer.use_v1=false", trace]))


@requires_verl("0.9.0", "no V1 trainer")
def test_a_command_that_checks_the_overrides_first_says_the_refusal_with_one_prefix(tmp_path, assets, capsys):
    """Issue 59: recipes/cpu_demo.sh's check of its overrides (verl_ext.apps.overrides, as the recipe runs it)
    and the selftest print a refused config after their own prefix: it read "verl-ext: verl-ext: …"."""
    from verl_ext.apps import overrides

    sub_steps = ["trainer.v1.trainer_mode=colocate_async", "+trainer.v1.colocate_async.parameter_sync_step=2"]
    with pytest.raises(SystemExit) as refused:
        overrides.main(["--output-dir", str(tmp_path), "--v1", "--", *sub_steps, f"+verl_ext.trace.dir={tmp_path / 'trace'}"])
    assert refused.value.code == 2
    assert capsys.readouterr().err == (
        "verl-ext: trainer.v1.trainer_mode=colocate_async runs 2 updates per step under one step number "
        "(trainer.v1.colocate_async.parameter_sync_step=2) and the trace keeps one per step, so 1 of every 2 would be "
        "missing from it: set trainer.v1.colocate_async.parameter_sync_step=1 or turn the trace off (remove verl_ext.trace.dir)\n"
    )


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
def test_a_trainer_with_its_own_fit_is_made_with_verl_ext_defaults_and_says_once_what_is_not_logged(mode, caplog):
    """The live metrics are on by default, but a run that asked verl-ext for nothing is not stopped: verl's own
    constructor runs (and, given no workers here, fails on its own terms) after one warning line."""
    trainer_class, name, module = experimental_trainers()[mode]
    with caplog.at_level("WARNING", logger="verl_ext"), pytest.raises(Exception) as failed:
        trainer_class(compose_config([]), None, {}, None)
    assert not str(failed.value).startswith("verl-ext:")
    assert [r.getMessage() for r in caplog.records if r.name == "verl_ext"] == [
        f"verl-ext: {name} ({module}) runs its own fit(), which never reaches verl-ext's step: verl-ext's live "
        "metrics are not logged in this run (set verl_ext.metrics=false to silence this line)"
    ]


@pytest.mark.parametrize("mode", MODES)
def test_the_line_lists_every_option_asked_for(tmp_path, mode):
    trainer_class, name, module = experimental_trainers()[mode]
    config = compose_config([
        f"+verl_ext.trace.dir={tmp_path / 'trace'}", "+verl_ext.metrics=false", "+verl_ext.turn_rewards=true",
        "+verl_ext.nonfinite=raise",
    ])  # fmt: skip
    with pytest.raises(ValueError) as stopped:
        trainer_class(config=config, tokenizer=None, role_worker_mapping={}, resource_pool_manager=None)
    assert str(stopped.value) == own_fit_line(
        name, module, "the trace, verl_ext.turn_rewards and verl_ext.nonfinite=raise",
        "remove verl_ext.trace.dir, set verl_ext.turn_rewards=false and set verl_ext.nonfinite=warn",
    )  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_a_trainer_with_its_own_fit_is_made_when_nothing_needs_verl_fit(mode):
    """With the live metrics off and nothing else asked for, verl's own constructor runs (and, given no
    workers here, fails on its own terms: an error that is not verl-ext's line)."""
    trainer_class, _, _ = experimental_trainers()[mode]
    with pytest.raises(Exception) as failed:
        trainer_class(compose_config(["+verl_ext.metrics=false"]), None, {}, None)
    assert not str(failed.value).startswith("verl-ext:")


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

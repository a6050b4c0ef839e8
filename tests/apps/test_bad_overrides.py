"""Issue 59, items 6 and 10: a bad argument or override of a command that starts a run (``demo``,
``selftest``, ``recipes/cpu_demo.sh``'s check, ``replay``) is one line on stderr and exit 2, before
anything starts: no folder, no trainer, no workers. Each class of error: an unknown estimator (the valid
names listed), a value of the wrong type for verl's typed config (which verl itself instantiates without
converting), a token that is not an override, a key the config does not have, a value verl's own
``validate_config`` refuses; and for the replay a clip ratio that is not > 0. When the replay's workers
fail for a reason not caught before them, the exception is said in one line, with their log, and the
work directory goes.

None of these trains: each refusal comes from composing and checking the config (seconds).

Covers: verl_ext.apps.composition (check_types, verl_validation), verl_ext.apps.demo.check_demo,
verl_ext.apps.selftest.check_selftest, verl_ext.apps.overrides, verl_ext.apps.replay (Overrides.parse,
check_overrides), verl_ext.apps.replay_model.run_replay."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

#: One override of each class of error, and what the one line must say (the key and the value).
BAD = {
    "unknown estimator": ("algorithm.adv_estimator=mcc", "algorithm.adv_estimator='mcc' is not a known advantage estimator. Valid names: "),
    "mistyped value": ("actor_rollout_ref.actor.ppo_epochs=abc", "actor_rollout_ref.actor.ppo_epochs=abc: Value 'abc' of type 'str' could not be converted to Integer"),
    "mistyped nested value": ("algorithm.kl_ctrl.kl_coef=high", "algorithm.kl_ctrl.kl_coef=high: Value 'high' of type 'str' could not be converted to Float"),
    "float for an integer": ("critic.ppo_epochs=1.5", "critic.ppo_epochs=1.5: Value '1.5' of type 'float' could not be converted to Integer"),
    "not an override": ("notanoverride", "Error parsing override 'notanoverride'"),
    "unknown key": ("algorithm.gama=0.9", "algorithm.gama is not a key of the trainer's config: did you mean algorithm.gamma?"),
    "refused by verl": ("actor_rollout_ref.actor.loss_agg_mode=foo", "verl's validate_config refuses the config: actor_rollout_ref.actor: Invalid loss_agg_mode: foo"),
}


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("case", ["unknown estimator", "mistyped value", "not an override", "unknown key", "refused by verl"])
def test_a_bad_demo_override_is_one_line_before_any_folder_or_trainer(run_cli, assets, tmp_path, case):
    """It printed the demo's first stage, a 32-76-line traceback from the trainer, exit 1, and left a
    folder with a train.log."""
    override, message = BAD[case]
    out = tmp_path / "demo"
    code, stdout, err = run_cli("demo", "--output-dir", str(out), "--steps", "2", "--", override)
    assert code == 2 and stdout == "" and out.exists() is False
    assert one_line(err).startswith("verl-ext demo: ") and message in err


def test_a_bad_demo_estimator_is_one_line_naming_the_valid_ones(run_cli, assets, tmp_path):
    code, stdout, err = run_cli("demo", "--output-dir", str(tmp_path / "demo"), "--estimator", "mcc")
    assert code == 2 and stdout == "" and not (tmp_path / "demo").exists()
    assert "algorithm.adv_estimator='mcc' is not a known advantage estimator. Valid names: " in one_line(err)
    assert ", mc, " in err and ", turn_gae" in err


@pytest.mark.parametrize("case", ["unknown estimator", "mistyped value", "not an override", "refused by verl"])
def test_a_bad_selftest_override_is_one_line_before_any_folder(run_cli, assets, tmp_path, case):
    override, message = BAD[case]
    out = tmp_path / "selftest"
    code, stdout, err = run_cli("selftest", "-q", "--output-dir", str(out), "--", override)
    assert code == 2 and stdout == "" and not out.exists()
    assert one_line(err).startswith("verl-ext selftest: ") and message in err


def test_the_recipes_check_refuses_what_verls_typed_config_or_validation_refuses(tmp_path, assets, capsys):
    """recipes/cpu_demo.sh's check (verl_ext.apps.overrides, which the recipe runs before Ray): these
    passed it and failed in the workers; a good config still prints nothing but the overrides (verl's
    validate_config prints, and the recipe reads stdout as the overrides)."""
    from verl_ext.apps import overrides

    for case in ("mistyped value", "mistyped nested value", "refused by verl"):
        override, message = BAD[case]
        with pytest.raises(SystemExit) as refused:
            overrides.main(["--output-dir", str(tmp_path), "--", override])
        line = one_line(capsys.readouterr().err)
        assert refused.value.code == 2 and line.startswith("verl-ext: ") and message in line, case
    overrides.main(["--output-dir", str(tmp_path), "--estimator", "mc"])
    printed = capsys.readouterr().out.splitlines()
    assert printed and all("=" in line for line in printed), printed


def test_the_recipe_refuses_a_bad_override_before_it_makes_its_folder(tmp_path, cpu_env, assets):
    """recipes/cpu_demo.sh made OUTPUT_DIR before its check refused the override."""
    out = tmp_path / "cpu_demo"
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "cpu_demo.sh"
    env = {**cpu_env(out), "OUTPUT_DIR": str(out), "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(recipe), BAD["unknown key"][0]], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and not out.exists()
    assert one_line(result.stderr) == f"verl-ext: {BAD['unknown key'][1]} (a new key is added with +algorithm.gama=…)"


def test_verls_typed_config_is_checked_only_where_verl_declares_a_type(assets, tmp_path):
    """The check converts as OmegaConf converts a value for verl's dataclasses: a whole number for an
    integer, a number for a float, true or false for a bool; verl's default config and a CPU run's on
    the V1 trainer pass it whole."""
    from verl_ext.apps.composition import check_types
    from verl_ext.cpu.overrides import compose_config, cpu_overrides
    from verl_ext.errors import UsageError

    check_types(compose_config([], None, "ppo_trainer"))
    config = compose_config(cpu_overrides(assets, tmp_path, use_v1=True), None, "ppo_trainer")
    check_types(config)
    for key, good, bad in (
        ("actor_rollout_ref.actor.ppo_epochs", 2, 1.0),
        ("actor_rollout_ref.actor.clip_ratio_high", 1, "wide"),
        ("actor_rollout_ref.actor.use_kl_loss", True, "maybe"),
        ("actor_rollout_ref.rollout.temperature", 0.7, "hot"),
    ):
        changed = config.copy()
        OmegaConf.update(changed, key, good)
        check_types(changed)
        OmegaConf.update(changed, key, bad)
        with pytest.raises(UsageError, match=f"^{key}={bad}: "):
            check_types(changed)


# --------------------------------------------------------------------------- replay


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory, assets):
    """What the replay's checks read of a trace: its run record's config (a CPU run's, composed here) and
    algorithm."""
    import verl_ext
    from verl_ext.apps.learning import learning_overrides
    from verl_ext.cpu.overrides import compose_config

    out = tmp_path_factory.mktemp("replayed_run")
    configs = Path(verl_ext.__file__).parent / "configs"
    config = OmegaConf.to_container(compose_config(learning_overrides(out, "mc", 0, 2, 2), configs, "verl_ext_trainer"), resolve=True)
    algorithm = {"adv_estimator": "mc", "gamma": 1.0, "lam": 1.0, "whiten_advantages": True, "truncation": "terminal"}
    return SimpleNamespace(path=str(out), record=SimpleNamespace(config=config, algorithm=algorithm))


@pytest.mark.parametrize("model", [False, True], ids=["model-free", "model"])
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor_rollout_ref.actor.clip_ratio_high=-5", "override actor_rollout_ref.actor.clip_ratio_high=-5: clip_ratio_high must be > 0"),
        ("actor_rollout_ref.actor.clip_ratio_low=0", "clip_ratio_low must be > 0"),
        ("actor_rollout_ref.actor.clip_ratio=-0.1", "override actor_rollout_ref.actor.clip_ratio=-0.1: clip_ratio_low must be > 0"),
        ("actor_rollout_ref.actor.clip_ratio_c=0.5", "clip_ratio_c must be > 1"),
        ("algorithm.adv_estimator=mcc", "algorithm.adv_estimator='mcc' is not a known advantage estimator. Valid names: "),
        ("algorithm.gama=0.9", "override algorithm.gama: not a key of the run's algorithm config: did you mean algorithm.gamma?"),
        ("algorithm.kl_ctrl.kl_coef=high", "algorithm.kl_ctrl.kl_coef=high: Value 'high' of type 'str' could not be converted to Float"),
        ("algorithm.n_step=0", "algorithm.n_step must be an integer >= 1, got 0"),
    ],
)
def test_a_bad_replay_override_is_refused_before_anything_is_replayed(recorded_run, model, override, message):
    """``-- actor_rollout_ref.actor.clip_ratio_high=-5`` was replayed (verl's ActorConfig takes any number);
    an unknown estimator was "not registered by its module"; a misspelt algorithm key was ignored."""
    from verl_ext.apps.replay import Overrides, ReplayError, check_overrides

    with pytest.raises(ReplayError) as refused:
        check_overrides(recorded_run, Overrides.parse([override], model=model), model=model)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor_rollout_ref.actor.ppo_epochs=abc", "actor_rollout_ref.actor.ppo_epochs=abc: Value 'abc' of type 'str' could not be converted to Integer"),
        ("critic.ppo_epochs=1.5", "critic.ppo_epochs=1.5: Value '1.5' of type 'float' could not be converted to Integer"),
        ("actor_rollout_ref.actor.loss_agg_mode=foo", "verl's validate_config refuses the config: actor_rollout_ref.actor: Invalid loss_agg_mode: foo"),
        ("actor_rollout_ref.actor.ppo_mini_batch_size=1000", "must be >= actor.ppo_mini_batch_size (1000)"),
    ],
)
def test_a_model_replay_override_verls_config_refuses_is_refused_before_the_workers(recorded_run, override, message):
    """``-- actor_rollout_ref.actor.ppo_epochs=abc`` built the workers, then said only "workers failed: see
    …/replay.log" and left that folder behind."""
    from verl_ext.apps.replay import Overrides, ReplayError, check_overrides

    with pytest.raises(ReplayError) as refused:
        check_overrides(recorded_run, Overrides.parse([override], model=True), model=True)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_good_replay_overrides_pass_the_checks(recorded_run):
    from verl_ext.apps.replay import Overrides, check_overrides

    for items in (["actor_rollout_ref.actor.clip_ratio_high=0.28", "algorithm.kl_ctrl.kl_coef=0.01"],
                  ["algorithm.adv_estimator=nstep", "algorithm.n_step=3", "actor_rollout_ref.actor.ppo_epochs=2", "critic.ppo_epochs=2"]):  # fmt: skip
        check_overrides(recorded_run, Overrides.parse(items, model=True), model=True)


TRACEBACK = """\
some progress line
[rank0]: Traceback (most recent call last):
[rank0]:   File "verl/utils/tensordict_utils.py", line 608, in get_data
[rank0]:     for _ in range(epochs):
[rank0]:              ^^^^^^^^^^^^^
[rank0]: TypeError: 'str' object cannot be interpreted as an integer
"""


@pytest.mark.parametrize(
    ("returncode", "stderr", "said"),
    [
        (1, TRACEBACK, "the replay's workers failed (exit 1): TypeError: 'str' object cannot be interpreted as an integer; their whole output: "),
        (-9, "loading the checkpoint\n", "the replay's workers failed (killed by SIGKILL): loading the checkpoint; their whole output: "),
    ],
)
def test_workers_that_fail_unexpectedly_are_said_in_one_line_and_only_their_log_stays(tmp_path, monkeypatch, returncode, stderr, said):
    """It said "the replay's workers failed (exit 1): see …/replay.log" and kept the work directory (the
    request, the batch, a partial checkpoint): now the exception itself, and their whole output in one
    file beside the work directory, which goes."""
    from verl_ext.apps import replay_model
    from verl_ext.apps.replay import ReplayError

    monkeypatch.setattr(replay_model.subprocess, "run", lambda command, **_: subprocess.CompletedProcess(command, returncode, "their stdout\n", stderr))
    work = tmp_path / "verl-ext-replay-x"
    with pytest.raises(ReplayError) as failed:
        replay_model.run_replay("trace", 2, "checkpoints", work, [], None)
    log = tmp_path / "verl-ext-replay-x.log"
    assert str(failed.value) == said + str(log)
    assert not work.exists() and log.read_text() == "their stdout\n" + stderr
    assert [path.name for path in tmp_path.iterdir()] == [log.name]


def test_the_workers_own_refusal_is_their_line_and_leaves_nothing(tmp_path, monkeypatch):
    from verl_ext.apps import replay_model
    from verl_ext.apps.replay import ReplayError

    refusal = "verl-ext replay: step 1 cannot be replayed with the model: why\n"
    monkeypatch.setattr(replay_model.subprocess, "run", lambda command, **_: subprocess.CompletedProcess(command, 2, "", refusal))
    with pytest.raises(ReplayError, match="^step 1 cannot be replayed with the model: why$"):
        replay_model.run_replay("trace", 1, "checkpoints", tmp_path / "work", [], None)
    assert list(tmp_path.iterdir()) == []

"""``verl-ext study``: a tiny study (two estimators, one seed, one step) writes well-formed outputs and
reuses its finished runs; every bad input is refused with one line and exit 2, before any training."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

import pytest

from tests.support.registry_helpers import isolated_registry  # noqa: F401 - a fixture
from verl_ext.apps.study import COLUMNS
from verl_ext.errors import UsageError


@pytest.fixture(scope="module")
def study(tmp_path_factory, cpu_env):
    # its own runs: what is tested is the `study` command, which starts (and reuses) its trainers itself
    out = tmp_path_factory.mktemp("study")
    command = [sys.executable, "-m", "verl_ext.cli", "study", "--estimators", "mc,grpo", "--seeds", "1",
               "--steps", "1", "--test-freq", "1", "--out", str(out)]  # fmt: skip
    first = subprocess.run(command, env=cpu_env(out), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = subprocess.run(command, env=cpu_env(out), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    return out, first.stdout, again.stdout


def test_results_csv_has_a_row_per_estimator_seed_and_step(study):
    out, _, _ = study
    with open(out / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == COLUMNS
    assert [(r["estimator"], r["seed"], r["step"]) for r in rows] == [
        (e, "0", str(step)) for e in ("mc", "grpo") for step in (0, 1)
    ]
    for row in rows:
        assert 0.0 <= float(row["val_acc"]) <= 1.0  # validated before training and after each step
        if row["step"] != "0":
            assert 0.0 <= float(row["score"]) <= 1.0 and 0.0 <= float(row["verdict_share"]) <= 1.0
            assert (row["critic_explained_var"] == "") == (row["estimator"] == "grpo")  # grpo has no critic


def test_summary_and_curves(study):
    out, _, _ = study
    summary = (out / "summary.md").read_text()
    table = [line for line in summary.splitlines() if line.startswith("| mc ") or line.startswith("| grpo ")]
    assert len(table) == 2 and "±" in table[0]
    assert "steps to ≥ 0.8" in summary
    assert (out / "learning_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_progress_lines_with_an_eta_and_finished_runs_reused(study):
    _, first, again = study
    progress = [line for line in first.splitlines() if line.startswith("[study] ") and "ETA" in line]
    assert len(progress) == 2 and all("held-out acc" in line for line in progress)
    assert again.count("(reused)") == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--estimators", "mc,bogus"], "unknown estimator bogus"),
        (["--seeds", "0"], "--seeds must be an integer >= 1, got 0"),
        (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
        (["--steps", "two"], "argument --steps: invalid int value: 'two'"),
    ],
)
def test_bad_input_is_refused_before_any_training(run_cli, tmp_path, argv, message):
    out = tmp_path / "study"
    try:
        code, _, err = run_cli("study", "--out", str(out), *argv)
    except SystemExit as exit_info:
        code, err = exit_info.code, ""
    assert code == 2
    if err:
        assert message in err and err.count("\n") == 1
    assert not out.exists() or not any(out.iterdir())


def test_an_unwritable_output_directory_is_refused(run_cli):
    code, _, err = run_cli("study", "--out", "/proc/x")
    assert code == 2 and err.startswith("verl-ext study: cannot write the study's outputs to /proc/x:") and err.count("\n") == 1


def test_argparse_errors_are_one_line_too():
    result = subprocess.run([sys.executable, "-m", "verl_ext.cli", "study", "--steps", "two", "--out", "x"],
                            capture_output=True, text=True, env={**os.environ})  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "argument --steps: invalid int value: 'two'" in result.stderr


# --------------------------------------------------------------------------- which estimators, with which recipe

USER_MODULE = '''
import verl_ext
from verl_ext.options import Option, positive_int


@verl_ext.register_estimator("{prefix}_critic")
def with_critic(rewards, values, response_mask, *, gamma, lam, config):
    return rewards + values, rewards


@verl_ext.register_estimator("{prefix}_free", needs_critic=False)
def critic_free(rewards, values, response_mask, *, gamma, lam, config):
    return rewards, rewards


@verl_ext.register_estimator("{prefix}_needs_k", options=(Option("k", positive_int, required=True),))
def needs_k(rewards, values, response_mask, *, gamma, lam, config):
    return rewards, rewards
'''


@pytest.fixture
def user_module(isolated_registry, tmp_path, monkeypatch):
    """A user's module of three estimators, named in VERL_USE_EXTERNAL_MODULES as the README says."""
    name = f"study_user_estimators_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE.format(prefix="mine"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", name)
    yield name
    sys.modules.pop(name, None)


def test_the_study_runs_the_recipes_then_every_registered_estimator_the_default_recipe_can_run(user_module):
    from verl_ext.apps.study import critics, recipe, study_estimators

    assert study_estimators() == ("mc", "td0", "nstep", "gae_ext", "gae", "grpo", "turn_gae", "mine_critic", "mine_free")
    assert study_estimators("mine_free, mc") == ("mine_free", "mc")
    # the default recipe: no options of its own; the critic as its registry entry says
    assert recipe("mine_critic") == recipe("mine_free") == [] and recipe("nstep") == ["algorithm.n_step=3"]
    assert critics("mine_critic", control=True) == ("pretrained", "fresh") and critics("mine_free", control=True) == ("none",)
    assert critics("grpo", control=True) == ("none",) and critics("gae", control=False) == ("pretrained",)
    with pytest.raises(UsageError, match="estimator mine_needs_k cannot run with the default recipe .*needs algorithm.k"):
        study_estimators("mc,mine_needs_k")
    with pytest.raises(UsageError, match="unknown estimator rloo: the study has a recipe for mc, td0, nstep, gae_ext, gae, grpo, turn_gae"):
        study_estimators("rloo")


def test_a_module_that_does_not_import_is_a_usage_error(monkeypatch):
    from verl_ext.apps.study import study_estimators

    monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "no_such_estimator_module")
    with pytest.raises(UsageError, match="cannot import no_such_estimator_module \\(VERL_USE_EXTERNAL_MODULES\\)"):
        study_estimators()


def test_the_summary_lists_the_default_recipe_of_a_studied_estimator():
    from verl_ext.apps.study import RunResult, StudySettings, summary_markdown

    rows = [{"estimator": "mine", "critic": "none", "seed": 0, "step": 0, "val_acc": 0.5, "score": 0.5,
             "critic_explained_var": None, "ev_after_verdict": None, "verdict_share": 0.1}]  # fmt: skip
    text = summary_markdown([RunResult("mine", "none", 0, 1.0, rows)], StudySettings(1, 1, 0.8))
    assert ("Options: mc (none); td0 (none); nstep n_step=3; gae_ext lam_critic=1.0 lam_actor=0.95; gae lam=0.95; "
            "grpo (none); turn_gae lam=0.0 lam_critic=1.0; mine (none).") in text  # fmt: skip

"""``verl-ext selftest`` on this machine, as a user types it (the ``selftest_run`` of tests/e2e/conftest.py,
with a user's overrides: verl's GPU settings in bf16): two real runs of verl's legacy trainer
(``python -m verl.trainer.main_ppo`` through the CPU backend) on the suite's Ray cluster
(``RAY_ADDRESS``, as a user's cluster), both traces checked; and a planted wrong estimator,
registered under a test name, that the selftest's check catches and names (on the traces of that
run, so that it costs no trainer run of its own).

Covers: verl_ext.apps.selftest (runs, a shared cluster, the check of both traces, the screen), the
``selftest`` command of verl_ext.cli, the hf_generate rollout (verl_ext.hf_rollout) on Ray."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.cpu.helpers import RAY_GROUP
from tests.support.registry_helpers import isolated_registry  # noqa: F401 - a fixture

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # one Ray run at a time, on the suite's cluster (tests/conftest.py)

WRONG_ESTIMATOR = "selftest_planted_wrong"


def test_selftest_passes_here_and_says_what_ran(selftest_run):
    from verl_ext.trace.reader import open_trace

    out, _, completed = selftest_run
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-6000:]
    lines = completed.stdout.splitlines()
    assert re.fullmatch(r"  mc +PASS +\d+ s", lines[-4]) and re.fullmatch(r"  grpo +PASS +\d+ s", lines[-3]), lines
    assert re.fullmatch(rf"PASS: selftest in \d+ s; outputs in {re.escape(str(out))}", lines[-1])
    shown = dict(line.strip().split(None, 1) for line in lines[1 : lines.index("")])
    assert shown["device"] == "cpu × 2 (1 node × 2)" and shown["rollout"].startswith("hf_generate ")
    assert shown["ranks"].startswith("data-parallel 2;")
    assert shown["trainer"] == "legacy RayPPOTrainer, hybrid engine"
    assert shown["batches"] == "packed (use_remove_padding), micro-batches by token count (use_dynamic_bsz)"
    assert shown["precision"].startswith("fsdp2 params bf16 (verl default), reductions fp32 (verl default)")
    assert shown["overrides"].startswith("actor_rollout_ref.model.use_remove_padding=True ")
    # what each run traced, from its run record: 2 steps of its estimator, with the critic and the update tables
    for estimator, responses_per_prompt, critic in (("mc", 1, True), ("grpo", 4, False)):
        trace = open_trace(str(out / estimator / "trace"))
        assert trace.steps == [1, 2] and trace.record.algorithm["adv_estimator"] == estimator
        assert trace.record.rollout_n == responses_per_prompt and trace.record.trainer == "legacy"
        # issue 59: the dtype its HF-generate server (a Ray actor) computed in on this CPU, float64 by the server's rule,
        # not the config's rollout.dtype (bfloat16, verl's default)
        assert trace.record.rollout["dtype"] == "float64"
        assert trace.update_steps == {"actor": [1, 2], "critic": [1, 2] if critic else []}
    # progress while it ran: each run's steps, on stderr
    assert "[selftest] mc: step 2/2 done" in completed.stderr and "[selftest] grpo: step 2/2 done" in completed.stderr
    assert "[selftest] mc: HF-generate rollout server up" in completed.stderr


def wandb_records(run_directory: Path, *options: str) -> list[dict]:
    """W&B's own reading of an offline run's transaction log (its ``.wandb`` file): ``wandb leet inspect --json``."""
    script = Path(sysconfig.get_path("scripts"), "wandb")
    completed = subprocess.run([str(script), "leet", "inspect", "--json", *options, str(run_directory)], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    return [json.loads(line) for line in completed.stdout.splitlines() if line.startswith("{")] if not options else [json.loads(completed.stdout)]


def test_each_run_is_a_finished_wandb_run_with_every_steps_metrics(selftest_run):
    """Issue 59: a run with verl's W&B logger on Ray lost its metrics. verl's legacy fit() left its logger to be
    finished at the task runner's exit, after W&B's service had gone: the offline run held the validation
    before training and nothing after, and said "running". Each run's W&B run, read back with W&B's reader,
    holds every step's metrics as verl's file logger wrote them (metrics.jsonl), verl-ext's live metrics
    (verl_ext/…) among them, and finished with exit code 0."""
    from verl_ext.apps.learning import read_metrics

    out = selftest_run[0]
    runs = {}
    for directory in sorted((out / "wandb" / "wandb").glob("offline-run-*")):
        summary = wandb_records(directory, "--summary")[0]
        runs[summary["name"]] = (summary, wandb_records(directory))
    assert sorted(runs) == ["selftest_grpo", "selftest_mc"]
    for estimator in ("mc", "grpo"):
        summary, records = runs[f"selftest_{estimator}"]
        assert (summary["state"], summary["exit_code"]) == ("finished", 0), summary
        history = {record["history"]["item"]["_step"]: record["history"]["item"] for record in records if record["type"] == "history"}
        logged = read_metrics(out / estimator)
        assert sorted(logged) == sorted(history) == [1, 2]
        for step, metrics in logged.items():
            assert any(key.startswith("verl_ext/critic/" if estimator == "mc" else "verl_ext/reward/") for key in metrics)
            assert {key: history[step].get(key) for key in metrics} == metrics, step
        # W&B's service shut down with the run, not by its exit hook once Ray had ended it: no traceback after training
        log = (out / estimator / "train.log").read_text()
        assert "ConnectionResetError" not in log and "Tracking.__del__" not in log


def test_a_wrong_estimator_fails_the_selftest_naming_the_identity(selftest_run, run_cli, tmp_path, monkeypatch, isolated_registry):
    """A test estimator that adds 1 to mc's returns and raw advantages. The trainer seam is replaced by
    a copy of the real mc run's trace that names it (the run record's estimator), as a run with
    ``algorithm.adv_estimator=selftest_planted_wrong`` would write it if the estimator were wrong."""
    from verl_ext import estimators
    from verl_ext.apps import selftest
    from verl_ext.trace.schema import RUN_RECORD

    @isolated_registry.register_estimator(WRONG_ESTIMATOR, uses_lam=False)  # gone after this test
    def planted(rewards, values, response_mask, *, gamma, lam, config):
        returns, advantages = estimators.mc(rewards, values, response_mask, gamma)
        return returns + 1.0, advantages + 1.0

    real = selftest_run[0] / "mc" / "trace"

    def train(overrides, directory, device, log, progress, started):
        estimator = [o.split("=", 1)[1] for o in overrides if o.startswith("algorithm.adv_estimator=")][-1]
        shutil.copytree(real, directory / "trace")
        record = json.loads((directory / "trace" / RUN_RECORD).read_text())
        record["algorithm"]["adv_estimator"] = estimator
        (directory / "trace" / RUN_RECORD).write_text(json.dumps(record))
        log.write_text("the planted run\n")
        return 0

    monkeypatch.setattr(selftest, "_train", train)
    monkeypatch.setenv("RAY_ADDRESS", "unused")  # no cluster is started for the planted runs
    code, out, _ = run_cli("selftest", "-q", "--output-dir", str(tmp_path), "--", f"algorithm.adv_estimator={WRONG_ESTIMATOR}")
    assert code == 1
    failed = [line for line in out.splitlines() if re.match(r"  (mc|grpo) +FAIL ", line)]
    assert len(failed) == 2, out
    for line in failed:  # every token is off by 1: the first identity in report order that reads them, at the first token
        assert re.search(r"  (advantage_raw|returns): step 1, sample 0, token 0: ", line), line
        assert "(log: " in line
    assert out.splitlines()[-1].startswith("FAIL: selftest in ")


def test_the_documented_lines_for_a_run_with_a_critic_say_why_on_the_grpo_run(selftest_run, run_cli, tmp_path, monkeypatch):
    """Every README and docs line whose comment says "a run with a critic", on the selftest's grpo run
    (no critic): one line that says why, exit 2 (tests/apps/test_readme_commands.py runs them on runs
    with a critic)."""
    from tests.apps.test_readme_commands import ANY_TRACE, DEMO_TRACE, NEEDS_A_CRITIC, TOOL_DEMO_TRACE, documented_lines, run_readme_lines

    monkeypatch.chdir(tmp_path)
    traced = {DEMO_TRACE, TOOL_DEMO_TRACE, ANY_TRACE}
    lines = [line for line in documented_lines() if NEEDS_A_CRITIC in line.partition("#")[2] and traced & set(line.split())]
    assert len(lines) >= 2  # summary --critic, compare
    run_readme_lines(lines, str(selftest_run[0] / "grpo" / "trace"), tmp_path, run_cli, has_critic=False)

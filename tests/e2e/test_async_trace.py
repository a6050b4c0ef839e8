"""verl's V1 trainer in ``separate_async`` mode, traced (issue 58): recipes/cpu_demo.sh with
``trainer.v1.trainer_mode=separate_async trainer.v1.separate_async.parameter_sync_step=2``, mc with its critic,
2 steps, on the suite's Ray cluster: the rollout on a logical GPU of its own, the weights sent to it after each
step through the CPU checkpoint engine, each step two local updates of half the batch, the second's π_old the
first's weights (verl's decoupled PPO). Every update is its own trace step (1-4: verl's steps 1 and 2, sub-steps
0 and 1), with update tables; the trace equals what each update read from TransferQueue (captured by
tests/e2e/v1_capture.py), each response's policy versions are its TransferQueue tags and reproduce verl's own
staleness metrics; the versions say which log-probs the weights share; the trace passes the checker.

The suite's one asynchronous run (CI time: the mode that exercises the most of the trace's async side, its
sub-steps; the one-step-off and fully-async trainers are run by hand: docs/cpu_backend.md).

Covers: verl_ext.integration.async_modes (positions, mode, versions from TransferQueue tags), the V1 seam's
sub-steps (step.Run.trace_step, update tables per sub-step), the run record's mode, verl_ext.check.async_checks
and update_checks.ratio_first's sub-steps on a real run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.cpu.helpers import RAY_GROUP, VERL_BATCH_KEYS, rows_of_the_batch

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # one Ray run at a time, on the suite's cluster (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "cpu_demo.sh"
STEPS, UPDATES = 2, 2
#: (trace step) -> (verl's step, sub-step, trainer version): verl syncs the rollout after step n's updates as n
PLACES = {1: (1, 0, 0), 2: (1, 1, 0), 3: (2, 0, 1), 4: (2, 1, 1)}


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, assets_dir, assets, ray_cluster):
    from tests.cpu.helpers import run

    out = tmp_path_factory.mktemp("separate_async")
    capture = out / "captured"
    capture.mkdir()
    overrides = [
        "trainer.v1.trainer_mode=separate_async",
        f"trainer.v1.separate_async.parameter_sync_step={UPDATES}",
        f"+verl_ext.trace.dir={out / 'trace'}",
        "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='tests.e2e.v1_capture'",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_EXT_TEST_CAPTURE_DIR='{capture}'",
        *ray_cluster.v1_overrides,
    ]
    env = {
        **os.environ, "PYTHON": sys.executable, "OUTPUT_DIR": str(out), "VERL_EXT_CPU_ASSETS": str(assets_dir), "V1": "1",
        "ESTIMATOR": "mc", "STEPS": str(STEPS), "RAY_ADDRESS": ray_cluster.address, "PYTHONPATH": str(ROOT),
        # the capture module for verl to import: the recipe then hands PYTHONPATH to every process of the run
        "VERL_USE_EXTERNAL_MODULES": "tests.e2e.v1_capture",
    }  # fmt: skip
    completed = run(["bash", str(RECIPE), *overrides], env, out, timeout=600)
    (out / "output.log").write_text(completed.stdout + completed.stderr)
    return out


def open_run_trace(out: Path):
    from verl_ext.trace.reader import open_trace

    return open_trace(str(out / "trace"))


def test_every_update_is_its_own_trace_step(async_run):
    trace = open_run_trace(async_run)
    record = trace.record
    assert record.trainer == "v1" and record.finished is True and record.planned_steps == STEPS * UPDATES
    # verl's settings as its ppo_trainer.yaml has them (the replay buffer's staleness control: drop beyond 8 steps)
    assert record.mode == {"name": "separate_async", "parameter_sync_step": UPDATES, "max_off_policy_threshold": 8, "max_off_policy_strategy": "drop"}
    assert trace.steps == list(PLACES) and trace.update_steps == {"actor": list(PLACES), "critic": list(PLACES)}
    for step, (global_step, substep, version) in PLACES.items():
        entry = trace.step_record(step)
        assert (entry.global_step, entry.substep, entry.trainer_version) == (global_step, substep, version)
        assert entry.samples == entry.batch_samples == 8 // UPDATES  # each update half of the 8 prompts


def test_the_trace_equals_what_each_update_read_and_its_versions_are_verls_tags(async_run):
    trace = open_run_trace(async_run)
    # no KL in the reward: verl stores no token_level_rewards, the reward is the score
    columns = {**VERL_BATCH_KEYS, "score": "rm_scores", "reward": "rm_scores"}
    for step, (global_step, substep, _) in PLACES.items():
        used = torch.load(async_run / "captured" / f"step{global_step}-{substep}.pt")
        table = trace.read_step(step).to_pandas()
        positions = rows_of_the_batch(table, used)
        compared = [column for column, key in columns.items() if key in used]  # no reference policy, no correction here
        assert set(compared) == {"score", "reward", "value", "return", "advantage", "old_log_prob", "rollout_log_prob"}
        for column in compared:
            np.testing.assert_array_equal(table[column].to_numpy(np.float32), used[columns[column]].float().numpy()[positions])
        prompts = trace.prompts(step).to_pandas()
        assert list(zip(prompts["policy_version_min"], prompts["policy_version_max"])) == used["versions"]


def test_the_versions_reproduce_verls_staleness_metrics(async_run):
    """verl's _compute_metrics over a step's samples (trainer_base.py:1978-1980): spans = max − min + 1, staleness
    = (global_steps − 1) − max, worst = (global_steps − 1) − min, per verl step over its updates' responses."""
    from verl_ext.apps.learning import read_metrics

    trace, metrics = open_run_trace(async_run), read_metrics(async_run)
    for global_step in range(1, STEPS + 1):
        prompts = [trace.prompts(s).to_pandas() for s, place in PLACES.items() if place[0] == global_step]
        low = np.concatenate([p["policy_version_min"].to_numpy() for p in prompts])
        high = np.concatenate([p["policy_version_max"].to_numpy() for p in prompts])
        ours = {"trajectory_spans": high - low + 1, "trajectory_staleness": global_step - 1 - high, "trajectory_staleness_worst": global_step - 1 - low}
        for name, values in ours.items():
            for statistic, value in (("mean", values.mean()), ("max", values.max()), ("min", values.min())):
                assert metrics[global_step][f"training/off_policy/{name}/{statistic}"] == pytest.approx(value), (global_step, name)
    # step 1 trains the first weights' responses (staleness 0); verl's step 2 still the warm-up batches they wrote
    assert [trace.step_record(s).trainer_version - trace.prompts(s).to_pandas()["policy_version_min"].max() for s in PLACES] == [0, 0, 1, 1]


def test_the_versions_say_which_weights_the_log_probs_share(async_run):
    """Where a response's version is the trainer's (staleness 0) the rollout's weights are π_old's: the log-probs
    agree to the rollout's float64 against the trainer's fp32; one sync later they do not. Within a step π_old is
    the first update's weights (decoupled PPO), so the second update's ratio starts away from 1."""
    trace = open_run_trace(async_run)
    for step, (_, substep, version) in PLACES.items():
        table = trace.read_step(step, ["sample", "mask", "old_log_prob", "rollout_log_prob"]).to_pandas()
        table = table[table["mask"]]
        gap = np.abs(table["old_log_prob"] - table["rollout_log_prob"]).max()
        stale = version - trace.prompts(step).to_pandas()["policy_version_min"].to_numpy()
        if (stale == 0).all():
            assert gap < 1e-4, (step, gap)
        else:
            assert (stale == 1).all() and gap > 1e-3, (step, gap)
        actor = trace.actor_update(step).to_pandas()
        first = actor[(actor["epoch"] == 0) & (actor["minibatch"] == 0)]
        departure = np.abs(first["ratio"] - 1).max()
        assert departure < 1e-5 if substep == 0 else departure > 1e-3, (step, departure)


def test_the_trace_passes_the_checker_with_the_version_identities(async_run):
    result = subprocess.run([sys.executable, "-m", "verl_ext.cli", "check", str(async_run / "trace"), "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    report = {r["identity"]: r for r in json.loads(result.stdout)["identities"]}
    assert report["policy_versions"]["status"] == "pass" and report["policy_versions"]["checked"] == 16
    assert report["staleness"]["status"] == "pass" and report["staleness"]["title"].endswith("≤ 7")
    assert report["update_metrics"]["status"] == "pass" and report["vf_loss"]["status"] == "pass"
    # the second update of each step: π_old is the step's first weights, not π_θ's at its start
    assert report["ratio_first"]["status"] == "pass"
    assert any(note.startswith("steps 2, 4: not applicable: update 2 of its sync cycle") for note in report["ratio_first"]["notes"])

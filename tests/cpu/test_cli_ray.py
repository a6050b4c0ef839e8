"""The real CLI, ``python -m verl.trainer.main_ppo``, on a local Ray cluster with the CPU backend."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from tests.cpu.helpers import RAY_GROUP, run
from verl_ext.tasks.arith.assets import DATA_SOURCE
from verl_ext.apps.learning import read_metrics
from verl_ext.cpu.overrides import cpu_overrides

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # Ray clusters run one at a time (tests/conftest.py)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "cpu_demo.sh"


def _main_ppo(assets, cpu_env, output_dir, *, steps, use_v1, estimator="gae"):
    overrides = cpu_overrides(assets, output_dir, steps=steps, estimator=estimator, use_v1=use_v1)
    run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], cpu_env(output_dir), output_dir, timeout=420)
    return read_metrics(output_dir), (output_dir / "output.log").read_text()


def _assert_trained(metrics, steps):
    assert sorted(metrics) == list(range(steps + 1))  # step 0: validation before training
    assert f"val-core/{DATA_SOURCE}/acc/mean@1" in metrics[0]  # the reward's acc, validated once per prompt
    for step in range(1, steps + 1):
        data = metrics[step]
        assert math.isfinite(data["critic/values/mean"]) and math.isfinite(data["critic/vf_loss"])
        assert data["actor/grad_norm"] > 0 and data["critic/grad_norm"] > 0
        assert 0.0 <= data["critic/score/mean"] <= 1.0


def test_cpu_demo_recipe_runs_the_legacy_trainer_five_steps(assets_dir, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUTPUT_DIR": str(tmp_path), "VERL_EXT_CPU_ASSETS": str(assets_dir)}
    completed = run(["bash", str(RECIPE)], env, tmp_path, timeout=420)
    assert "[step 5/5]" in completed.stdout and str(tmp_path) in completed.stdout  # progress, where outputs are
    _assert_trained(read_metrics(tmp_path), 5)
    log = (tmp_path / "train.log").read_text()
    assert "(TaskRunner pid=" in log and "hf-generate/replica-0" in log  # legacy trainer, hf rollout


def test_v1_trainer_runs_verl_ext_mc_with_verls_own_config(assets, cpu_env, tmp_path):
    """verl 0.9's default trainer, verl's own ppo_trainer.yaml, `algorithm.adv_estimator=mc` and nothing
    else: the plugin registers the estimator, switches the critic on and hands it the values."""
    metrics, log = _main_ppo(assets, cpu_env, tmp_path, steps=2, use_v1=True, estimator="mc")
    _assert_trained(metrics, 2)  # critic values and critic updates at every step
    assert "(TaskRunnerV1 pid=" in log

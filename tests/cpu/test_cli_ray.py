"""recipes/cpu_demo.sh: the real CLI, ``python -m verl.trainer.main_ppo``, on a local Ray cluster with the
CPU backend (verl's V1 trainer through the CLI: tests/e2e/test_v1_trace.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.cpu.helpers import RAY_GROUP, assert_trained, run
from verl_ext.apps.learning import read_metrics

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # Ray clusters run one at a time (tests/conftest.py)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "cpu_demo.sh"


def test_cpu_demo_recipe_runs_the_legacy_trainer_five_steps(assets_dir, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUTPUT_DIR": str(tmp_path), "VERL_EXT_CPU_ASSETS": str(assets_dir)}
    completed = run(["bash", str(RECIPE)], env, tmp_path, timeout=420)
    assert "[step 5/5]" in completed.stdout and str(tmp_path) in completed.stdout  # progress, where outputs are
    assert_trained(read_metrics(tmp_path), 5)
    log = (tmp_path / "train.log").read_text()
    assert "(TaskRunner pid=" in log and "hf-generate/replica-0" in log  # legacy trainer, hf rollout

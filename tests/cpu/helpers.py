"""Helpers of the CPU-backend tests: running a command in a fresh interpreter, reading verl's outputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCENARIOS = Path(__file__).with_name("scenarios.py")
CONFIGS = Path(__file__).resolve().parents[2] / "verl_ext" / "configs"

#: The ``xdist_group`` of the tests that start a Ray cluster: they run one after the other on one
#: pytest-xdist worker (why: tests/conftest.py, ``pytest_collection_modifyitems``).
RAY_GROUP = "ray"
#: The ``xdist_group`` of tests that load both cores by themselves (two trainers at once): they run
#: after the Ray group, on its worker (why: tests/conftest.py, ``pytest_collection_modifyitems``).
BOTH_CORES_GROUP = "both-cores"

#: The token table's columns and the keys of verl's batch each is taken from, written here by hand (not
#: read from verl_ext's column registry, which is what the tests hold to them). The score's key differs
#: by trainer: ``token_level_scores`` on the legacy trainer, ``rm_scores`` on V1.
VERL_BATCH_KEYS = {
    "reward": "token_level_rewards",
    "value": "values",
    "return": "returns",
    "advantage": "advantages",
    "old_log_prob": "old_log_probs",
    "ref_log_prob": "ref_log_prob",
    "rollout_log_prob": "rollout_log_probs",
    "rollout_is_weight": "rollout_is_weights",
}


def rows_of_the_batch(table, used: dict) -> tuple:
    """The (sample, token_index) of each row of a step's token table (pandas), as indices into the batch an
    update read (``used``: tests/e2e/v1_capture.py's file); the table has a row per sample and the batch's
    response mask and token ids at them."""
    mask = used["response_mask"].numpy()
    assert table["sample"].nunique() == mask.shape[0]
    positions = (table["sample"].to_numpy(), table["token_index"].to_numpy())
    assert (table["mask"].to_numpy() == (mask[positions] != 0)).all()
    assert (table["token_id"].to_numpy() == used["responses"].numpy()[positions]).all()
    return positions


def run(command: list[str], env: dict[str, str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """Run ``command`` (its output is kept in ``cwd/output.log``); on failure show the end of it."""
    completed = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    (cwd / "output.log").write_text(completed.stdout + completed.stderr)
    if completed.returncode != 0:
        tail = (completed.stdout + completed.stderr)[-6000:]
        pytest.fail(f"{' '.join(command[:4])} ... exited with {completed.returncode}:\n{tail}")
    return completed


def main_ppo_with_verl_ext_config(overrides: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """``python -m verl.trainer.main_ppo`` with verl-ext's config (verl's ppo_trainer extended), via :func:`run`."""
    command = [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={CONFIGS}", "--config-name=verl_ext_trainer"]
    return run([*command, *overrides], env, cwd, timeout=600)


def assert_trained(metrics: dict[int, dict], steps: int, task: str = "arith") -> None:
    """verl's metrics (``read_metrics``) of a run of ``task`` that validated first, then trained ``steps`` steps
    with a critic: values, losses and both gradients at every step."""
    import importlib
    import math

    data_source = importlib.import_module(f"verl_ext.tasks.{task}.assets").DATA_SOURCE
    assert sorted(metrics) == list(range(steps + 1))  # step 0: validation before training
    assert f"val-core/{data_source}/acc/mean@1" in metrics[0]  # the reward's acc, validated once per prompt
    for step in range(1, steps + 1):
        data = metrics[step]
        assert math.isfinite(data["critic/values/mean"]) and math.isfinite(data["critic/vf_loss"])
        assert data["actor/grad_norm"] > 0 and data["critic/grad_norm"] > 0
        assert 0.0 <= data["critic/score/mean"] <= 1.0


def read_batches(output_dir: Path) -> dict:
    """What the in-process scenario recorded: ``{"steps": {step: tensors}, "gamma": .., "lam": ..,
    "agent_loops": {"built": .., "runs": ..}}``."""
    import torch

    return torch.load(output_dir / "batches.pt", weights_only=False)

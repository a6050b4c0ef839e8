from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from packaging.version import Version

from verl_ext.options import ALGORITHM_KEYS

CONFIG_DIR = Path(__file__).resolve().parents[2] / "verl_ext" / "configs"


def verl_version() -> Version:
    import verl

    return Version(verl.__version__)


def requires_verl(minimum: str, why: str):
    return pytest.mark.skipif(verl_version() < Version(minimum), reason=f"verl < {minimum}: {why}")


@pytest.fixture(scope="session")
def compose():
    """Compose verl's own ppo_trainer.yaml with overrides, as a user without verl-ext's yaml does:
    keys verl-ext adds get the ``+`` hydra needs for keys the config does not declare."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module

    added = tuple(f"algorithm.{key}=" for key in ALGORITHM_KEYS) + ("verl_ext.",)

    def _compose(*overrides: str):
        overrides = [f"+{o}" if o.startswith(added) else o for o in overrides]
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            return hydra_compose(config_name="ppo_trainer", overrides=overrides)

    return _compose


def make_batch(rows=6, length=20, seed=0, holes=True):
    """rewards, values and a response mask with mixed lengths (and interior holes)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, length + 1, size=rows)
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)
    if holes:
        mask[:, 3:5] = 0
        mask[:, 0] = 1
    rewards = np.where(mask == 1, rng.normal(size=(rows, length)), 0.0)
    values = rng.normal(size=(rows, length))
    return (
        torch.tensor(rewards, dtype=torch.float32),
        torch.tensor(values, dtype=torch.float32),
        torch.tensor(mask),
    )


def run_python(code: str, env_extra: dict | None = None, timeout=180) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter of this venv (plugins and patches are process-global)."""
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout
    )

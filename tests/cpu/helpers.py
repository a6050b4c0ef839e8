"""Helpers of the CPU-backend tests: running a command in a fresh interpreter, reading verl's outputs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

SCENARIOS = Path(__file__).with_name("scenarios.py")


def run(command: list[str], env: dict[str, str], cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """Run ``command`` (its output is kept in ``cwd/output.log``); on failure show the end of it."""
    completed = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    (cwd / "output.log").write_text(completed.stdout + completed.stderr)
    if completed.returncode != 0:
        tail = (completed.stdout + completed.stderr)[-6000:]
        pytest.fail(f"{' '.join(command[:4])} ... exited with {completed.returncode}:\n{tail}")
    return completed


def read_metrics(output_dir: Path) -> dict[int, dict]:
    """verl's per-step metrics (its ``file`` logger) by step."""
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["data"] for record in map(json.loads, lines)}


def read_batches(output_dir: Path) -> dict:
    """What the in-process scenario recorded: ``{"steps": {step: tensors}, "gamma": .., "lam": ..}``."""
    import torch

    return torch.load(output_dir / "batches.pt", weights_only=False)

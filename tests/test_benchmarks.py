"""The benchmark scripts still run (at tiny sizes; what they measure is theirs to print, not a test's).
bench_trace.py once went on calling a StepCapture field that had been renamed, unnoticed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "script, arguments",
    [
        ("bench_trace.py", ["--batch", "8", "--length", "64", "--repeats", "1"]),
        ("bench_check.py", ["--tokens", "2000", "--steps", "2", "--samples", "8", "--repeat", "1"]),
        ("bench_update_payload.py", ["--ranks", "1", "--samples", "4", "--response", "8", "--epochs", "1"]),
    ],
)
def test_a_benchmark_runs(script, arguments, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *arguments], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]

"""The benchmark scripts still run (at tiny sizes) and report what they say they measure: the figures
are theirs to print, not a test's, but each line a script exists for is there, about the sizes it was
given. bench_trace.py once went on calling a StepCapture field that had been renamed, unnoticed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _trace_report(out: str) -> None:
    assert re.search(r"synchronous submit time: min [\d.]+ ms, median [\d.]+ ms", out)
    bytes_per_row = float(re.search(r"on disk: ([\d.]+) bytes per token row", out).group(1))
    assert bytes_per_row > 0
    # one peak-memory line per queue size, each with the steps submitted back to back (queue_size + 3)
    queues = [(int(q), int(n)) for q, n in re.findall(r"queue_size (\d+): peak RSS growth \d+ MiB while (\d+) steps", out)]
    assert queues == [(1, 4), (2, 5), (4, 7)], queues


def _check_report(out: str) -> None:
    line = re.search(r"check: ([\d,]+) valid tokens in (\d+) steps, best of 1: ([\d.]+) s = [\d.]+ M tokens/s end to end.* jobs=1 tokens_per_s=(\d+)$", out, re.M)
    tokens, steps, seconds, per_second = line.groups()
    assert steps == "2" and 1_000 <= int(tokens.replace(",", "")) <= 4_000  # --tokens 2000 over the run, drawn lengths
    assert int(per_second) > 0 and float(seconds) >= 0


def _payload_report(out: str) -> None:
    sizes = {kind: (int(ranks), int(size)) for kind, ranks, size in re.findall(r"(new|old) \(.*\) ranks=(\d+) bytes=(\d+)", out)}
    assert sizes.keys() == {"new", "old"} and sizes["new"][0] == sizes["old"][0] == 1
    assert 0 < sizes["new"][1] <= sizes["old"][1]  # one gather to rank 0 never carries more than verl's all-gather


@pytest.mark.parametrize(
    "script, arguments, expect",
    [
        ("bench_trace.py", ["--batch", "8", "--length", "64", "--repeats", "1"], _trace_report),
        ("bench_check.py", ["--tokens", "2000", "--steps", "2", "--samples", "8", "--repeat", "1"], _check_report),
        ("bench_update_payload.py", ["--ranks", "1", "--samples", "4", "--response", "8", "--epochs", "1"], _payload_report),
    ],
)
def test_a_benchmark_runs_and_reports(script, arguments, expect, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *arguments], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    expect(result.stdout)

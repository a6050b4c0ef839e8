"""``verl-ext check --ray`` and ``summary --ray`` on the suite's Ray cluster (tests/e2e/conftest.py): the
steps as Ray tasks on its worker node give the report and the table of one process, byte for byte.

Covers: verl_ext.trace.parallel's Ray path, the CLI's --ray."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.cpu.helpers import RAY_GROUP
from tests.view.view_helpers import save_piece_tokenizer, write_view_trace

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # one Ray run at a time, on the suite's cluster (tests/conftest.py)


def verl_ext(*arguments: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl_ext.cli", *arguments], capture_output=True, text=True, env=env, timeout=300)


def test_check_and_summary_as_ray_tasks_are_the_serial_ones(tmp_path, ray_cluster, run_cli):
    trace = write_view_trace(tmp_path / "trace", save_piece_tokenizer(tmp_path / "tok"), steps=(1, 2, 3), nudged=(2, 1, 3))
    on_ray = verl_ext("check", trace, "--json", "--ray", ray_cluster.address)
    assert on_ray.returncode == 1, on_ray.stderr[-3000:]  # the nudged return fails
    assert run_cli("check", trace, "--json", "--jobs", "1")[:2] == (1, on_ray.stdout)
    # without an address: the cluster RAY_ADDRESS names
    on_ray = verl_ext("summary", trace, "--format", "csv", "--ray", env={**os.environ, "RAY_ADDRESS": ray_cluster.address})
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    assert run_cli("summary", trace, "--format", "csv", "--jobs", "1", "-q")[:2] == (0, on_ray.stdout) and on_ray.stdout.count("\n") == 4

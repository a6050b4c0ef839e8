"""``verl-ext check --ray`` and ``summary --ray`` on the suite's Ray cluster (tests/e2e/conftest.py): the
steps as Ray tasks on its worker node give the report and the table of one process, byte for byte; a
Ray worker that dies is one line.

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


def test_a_ray_worker_that_dies_is_one_line_not_a_traceback(tmp_path, ray_cluster, run_cli, monkeypatch):
    """`check --ray` whose task at step 2 kills its Ray worker (tests/e2e/dying_ray_task.py): Ray's
    WorkerCrashedError becomes WorkerLost, one line and exit 2, as a worker process's death does
    (tests/inspect/test_parallel_steps.py); the task is not retried (it would die again)."""
    from tests.e2e import dying_ray_task
    from verl_ext.trace import parallel

    trace = write_view_trace(tmp_path / "trace", save_piece_tokenizer(tmp_path / "tok"), steps=(1, 2, 3))
    (tmp_path / "kill-step-2").touch()
    monkeypatch.setattr(parallel, "_in_ray_task", dying_ray_task.in_ray_task)  # what map_steps sends to Ray
    code, out, err = run_cli("check", trace, "--ray", ray_cluster.address, "-q")
    assert code == 2 and err.count("\n") == 1, (code, err)
    # no report; what stdout may hold is the notice Ray's driver prints itself, "(raylet) A worker died …"
    assert all("(raylet)" in line for line in out.splitlines()), out
    assert err.startswith("verl-ext check: a Ray worker ended before returning step 2 (WorkerCrashedError: killed, e.g. out of memory"), err
    assert (tmp_path / "kills").read_text() == "2\n"  # once: not retried

"""verl's real trainer (the CPU backend) on a two-node Ray cluster on one machine (the suite's cluster,
tests/e2e/conftest.py): the head node has no CPU to offer, so verl's TaskRunner, which writes the
trace, and its workers run on the other node.

The plugin must load from its entry point in every process (recorded by tests/e2e/activation_probe.py
once verl's core_algos is imported), the run must say at start which node writes the local trace
directory, the run record must name that node, and the trace must be complete and pass the checker.
The run is the mc run of ``verl-ext selftest`` (tests/e2e/conftest.py), in verl's GPU settings: bf16,
packed sequences, entropy in the loss, dynamic batch size (tests/e2e/gpu_world.py).

Covers: verl_ext.integration's plugin activation (entry point, every process) and its trace_hook on a
Ray node other than the driver's (run record, node), its update_hook and the check's bf16 tolerances
(verl_ext.check.update_checks) in a bf16 run, verl_ext.trace (writer, reader),
verl_ext.check.run through verl_ext.cli, and the CPU backend (verl_ext.cpu) on Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu.helpers import RAY_GROUP

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # one Ray run at a time, on the suite's cluster (tests/conftest.py)


@pytest.fixture(scope="module")
def multinode_run(selftest_run, ray_cluster):
    """The mc run of ``verl-ext selftest`` (tests/e2e/conftest.py): the legacy trainer on this cluster."""
    out, probes, completed = selftest_run
    assert completed.returncode == 0, (completed.stdout + completed.stderr)[-6000:]
    reports = [json.loads(path.read_text()) for path in probes.glob("*.json")]
    run = out / "mc"
    return run, ray_cluster.worker_node, ray_cluster.head_node, reports, (run / "train.log").read_text()


def test_the_plugin_loads_from_its_entry_point_in_every_process(multinode_run):
    _, worker, head, reports, _ = multinode_run
    assert len(reports) >= 3  # the driver, the TaskRunner, the workers
    assert {r["node"] for r in reports} >= {None, worker}  # the driver is not a Ray worker
    for report in reports:
        assert report["loaded"] and report["activated_by"] == "entry point", report


def test_the_run_says_which_node_writes_and_records_it(multinode_run):
    from verl_ext.trace.reader import open_trace

    out, worker, head, _, log = multinode_run
    record = open_trace(str(out / "trace")).record
    assert record.node == worker != head
    notes = [line for line in log.splitlines() if "verl-ext trace: 2-node Ray cluster" in line]
    assert len(notes) == 1 and f"{out / 'trace'} is written on the TaskRunner's node {worker[:12]}" in notes[0]
    assert "shared filesystem or an fsspec URL" in notes[0]


def test_the_trace_is_complete_and_passes_the_checker(multinode_run):
    from verl_ext.trace.reader import open_trace

    out, *_ = multinode_run
    trace = open_trace(str(out / "trace"))
    assert trace.steps == [1, 2] and sorted(trace.record.steps) == ["1", "2"]
    assert trace.update_steps == {"actor": [1, 2], "critic": [1, 2]}
    result = subprocess.run(
        [sys.executable, "-m", "verl_ext.cli", "check", str(out / "trace"), "--quiet"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-3000:]


def test_each_update_row_arrives_once_from_both_ranks(multinode_run):
    """verl's driver fetches every collecting rank's output and keeps the first: on this run's two
    data-parallel ranks the update tables hold each trainable (sample, token) of the token table once per
    PPO epoch, trained on either rank (the rows of both gathered into rank 0's output; that only that
    output carries them, and the bytes, are checked in tests/integration/test_update_hook.py and
    benchmarks/bench_update_payload.py)."""
    from verl_ext.trace.reader import open_trace

    out, *_ = multinode_run
    trace = open_trace(str(out / "trace"))
    for step in trace.steps:
        tokens = trace.read_step(step, columns=["sample", "token_index", "mask"]).to_pydict()
        trainable = {(s, t) for s, t, m in zip(tokens["sample"], tokens["token_index"], tokens["mask"]) if m}
        for kind in ("actor", "critic"):
            table = trace.update_table(kind, step, columns=["sample", "token_index", "epoch", "rank"]).to_pydict()
            keys = list(zip(table["sample"], table["token_index"], table["epoch"]))
            epochs = trace.record.update[kind]["ppo_epochs"]
            assert len(keys) == len(set(keys)) == len(trainable) * epochs, (kind, step)
            assert {(s, t) for s, t, _ in keys} == trainable and set(table["rank"]) == {0, 1}


def test_the_run_is_in_verls_gpu_settings_and_its_trace_holds_the_bf16_numbers_it_used(selftest_run):
    from tests.e2e.gpu_world import assert_gpu_world

    out = selftest_run[0]
    for estimator, critic in (("mc", True), ("grpo", False)):
        assert_gpu_world(out / estimator, out / estimator / "trace", critic=critic)

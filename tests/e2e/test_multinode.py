"""verl's real trainer (the CPU backend) on a two-node Ray cluster on one machine (the suite's cluster,
tests/e2e/conftest.py): the head node has no CPU to offer, so verl's TaskRunner, which writes the
trace, and its workers run on the other node.

The plugin must load from its entry point in every process (recorded by tests/e2e/activation_probe.py
once verl's core_algos is imported), the run must say at start which node writes the local trace
directory, the run record must name that node, and the trace must be complete and pass the checker.

Covers: verl_ext.integration's plugin activation (entry point, every process) and its trace_hook on a
Ray node other than the driver's (run record, node), verl_ext.trace (writer, reader),
verl_ext.inspect.check through verl_ext.cli, and the CPU backend (verl_ext.cpu) on Ray.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu.helpers import RAY_GROUP

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # one Ray run at a time, on the suite's cluster (tests/conftest.py)


@pytest.fixture(scope="module")
def multinode_run(ray_cluster, tmp_path_factory, assets):
    # its own run: the legacy trainer on Ray, with a probe of the plugin's activation in every process
    from verl_ext.cpu.overrides import cpu_environment, cpu_overrides, merge_overrides

    from tests.cpu.helpers import main_ppo_with_verl_ext_config

    out = tmp_path_factory.mktemp("multinode")
    probes = out / "probes"
    probes.mkdir()
    overrides = merge_overrides(
        cpu_overrides(assets, out, steps=2, estimator="mc", ray_address=ray_cluster.address),
        [
            f"verl_ext.trace.dir={out / 'trace'}",
            "trainer.val_before_train=False",  # nothing here reads a validation
            "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES=tests.e2e.activation_probe",
            f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_EXT_TEST_PROBE_DIR='{probes}'",
            f"+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH='{ROOT}'",
        ],
    )
    env = {
        **os.environ, **cpu_environment(out), "PYTHONPATH": str(ROOT),
        "VERL_USE_EXTERNAL_MODULES": "tests.e2e.activation_probe", "VERL_EXT_TEST_PROBE_DIR": str(probes),
    }  # fmt: skip
    result = main_ppo_with_verl_ext_config(overrides, env, out)
    reports = [json.loads(path.read_text()) for path in probes.glob("*.json")]
    return out, ray_cluster.worker_node, ray_cluster.head_node, reports, result.stdout + result.stderr


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

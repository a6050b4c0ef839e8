"""The tool task on Ray with verl 0.9's default V1 trainer (recipes/cpu_demo.sh, ``TASK=tool V1=1``):
verl's ToolAgentLoop in a Ray agent-loop worker, the agent loop's record of each sample's turns carried
through TransferQueue's ``extra_fields`` into the trace. Every response is checked against the task's
definition (tests/apps/test_tool_demo.py) and the trace passes the checker. (In process, the legacy
trainer: tests/apps/test_tool_demo.py.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.cpu.helpers import RAY_GROUP

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # Ray clusters run one at a time (tests/conftest.py)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "cpu_demo.sh"


@pytest.fixture(scope="module")
def v1_tool_run(tmp_path_factory, assets_dir):
    from tests.cpu.helpers import run

    out = tmp_path_factory.mktemp("v1_tool")
    env = {
        **os.environ, "PYTHON": sys.executable, "OUTPUT_DIR": str(out), "VERL_EXT_CPU_ASSETS": str(assets_dir),
        "TASK": "tool", "V1": "1", "ESTIMATOR": "grpo", "ROLLOUT_N": "4", "STEPS": "2",
    }  # fmt: skip
    run(["bash", str(RECIPE), f"+verl_ext.trace.dir={out / 'trace'}"], env, out, timeout=600)
    return out


def test_the_v1_trainer_traces_the_tool_loops_turns(v1_tool_run):
    from tests.apps.test_tool_demo import count_checked_tool_calls
    from verl_ext.inspect.check import check_trace
    from verl_ext.trace.reader import open_trace

    assert "(TaskRunnerV1 pid=" in (v1_tool_run / "train.log").read_text()
    trace = open_trace(str(v1_tool_run / "trace"))
    assert trace.record.trainer == "v1" and trace.steps == [1, 2]
    assert count_checked_tool_calls(trace) >= 5  # of 64 responses, about 3 in 10 call
    report = check_trace(trace)
    assert report.passed and {"turns", "roles"} <= {r.identity for r in report.identities if r.status == "pass"}

"""The learning run that tests/apps/test_learning.py and test_credit.py share: verl's real trainer (in
process) on the CPU task, ``mc``, seed 0, and beside it the same run for its first few steps only (the
reproducibility check compares the two). Both modules are in the xdist group of two trainers at once,
so one worker runs them and the session fixture trains once. And the run of ``verl-ext demo --task tool``
that tests/apps/test_tool_demo.py and test_readme_commands.py share."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tests.cpu.helpers import run

#: The steps of the learning run: 12 (held-out accuracy 0.598 -> 0.798 on this machine; 0.731 after the 25 the
#: suite ran until issue 55, whose 13 steps more took 22 s of its longest chain). Above 10: the demo's credit
#: lines (every tenth step, the first and the last) then have a line that is neither.
LEARNING_STEPS = 12
#: The steps of the second run: within the learning recipe's warm-up (5 steps), so that its learning
#: rate, which a cosine schedule over the run's length sets after the warm-up, is the long run's.
REPRODUCED_STEPS = 3


@pytest.fixture(scope="session")
def learning_runs(tmp_path_factory, cpu_env):
    # its own runs: the learning recipe (LEARNING_STEPS, verl_ext.apps.learning), which no other test runs
    outputs = [tmp_path_factory.mktemp(f"learn{i}") for i in range(2)]
    command = [sys.executable, "-m", "verl_ext.apps.learning", "--estimator", "mc", "--seed", "0",
               "--test-freq", str(LEARNING_STEPS), "--trace"]  # fmt: skip
    processes = [
        subprocess.Popen([*command[:3], str(out), *command[3:], "--steps", str(steps)], env=cpu_env(out), cwd=out,
                         stdout=open(out / "output.log", "w"), stderr=subprocess.STDOUT)  # fmt: skip
        for out, steps in zip(outputs, (LEARNING_STEPS, REPRODUCED_STEPS))
    ]
    for process, out in zip(processes, outputs):
        if process.wait(timeout=600) != 0:
            pytest.fail(f"learning run failed:\n{(out / 'output.log').read_text()[-4000:]}")
    return outputs


#: The steps of the tool demo's run: a few, since what its tests read is the command's work, not learning.
TOOL_DEMO_STEPS = 3
#: The ``xdist_group`` of the tests that read the tool demo's run (tests/apps/test_tool_demo.py and
#: test_readme_commands.py): one worker runs them all, so that the session fixture runs once.
TOOL_DEMO_GROUP = "tool-demo"


@pytest.fixture(scope="session")
def tool_demo(tmp_path_factory, cpu_env):
    """``verl-ext demo --task tool --turn-rewards``, a few steps: (its output directory, its stdout)."""
    # its own run: what is tested is the `demo --task tool` command, which starts its trainer itself
    out = tmp_path_factory.mktemp("tool_demo")
    command = [
        # the reproducible rollout (docs/tasks.md): the demo's default is verl's vLLM where vLLM's CPU build is installed
        sys.executable, "-m", "verl_ext.cli", "demo", "--task", "tool", "--turn-rewards", "--steps", str(TOOL_DEMO_STEPS), "--rollout", "hf_generate",
        "--output-dir", str(out),
    ]  # fmt: skip
    return out, run(command, cpu_env(out), out, timeout=600).stdout


@pytest.fixture(scope="session")
def learning_trace(learning_runs):
    from verl_ext.trace.reader import open_trace

    return open_trace(str(learning_runs[0] / "trace"))


def dense(frame: pd.DataFrame, column: str) -> np.ndarray:
    """(samples, T) of a token table's column, 0 where there is no row."""
    width = int(frame["token_index"].max()) + 1
    out = np.zeros((int(frame["sample"].max()) + 1, width))
    out[frame["sample"], frame["token_index"]] = frame[column].to_numpy(np.float64)
    return out


def valid_tokens(frame: pd.DataFrame) -> pd.DataFrame:
    """The valid tokens; each response's mask is a prefix, so token_index is also the rank."""
    valid = frame[frame["mask"]]
    assert (valid.groupby("sample")["token_index"].max() + 1 == valid.groupby("sample").size()).all()
    return valid


def documented_before(row: str) -> tuple[float, float]:
    """The "held-out accuracy before" of a demo's row (``row``: its first cell) in docs/tasks.md's
    tables: the range over the machines measured, (low, high), written "0.331–0.333" or, where every
    machine printed the same, "0.598"."""
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "tasks.md").read_text(encoding="utf-8")
    low, high = re.search(rf"^\| {re.escape(row)} \| ([\d.]+)(?:–([\d.]+))? \|", text, re.MULTILINE).groups()
    return float(low), float(high or low)


#: The documented accuracies are rounded to three decimals.
DOCUMENTED_ROUNDING = 5e-4

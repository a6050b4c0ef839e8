"""Resuming a traced run from an earlier checkpoint re-traces the steps it repeats: each such step
is replaced by the resumed run's batch, never duplicated, and the earlier steps are kept."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from tests.cpu.helpers import SCENARIOS, read_batches, run

ROOT = Path(__file__).resolve().parents[2]


def train(out: Path, steps: int, *overrides: str) -> dict:
    command = [
        sys.executable, str(SCENARIOS), "in-process", str(out), "--estimator", "mc", "--steps", str(steps),
        "--config-dir", str(ROOT / "verl_ext" / "configs"), "--config-name", "verl_ext_trainer", "--",
        "trainer.val_before_train=False", f"verl_ext.trace.dir={out / 'trace'}", *overrides,
    ]  # fmt: skip
    run(command, env={**os.environ, "VERL_EXT_CPU": "1"}, cwd=out, timeout=600)
    return read_batches(out)["steps"]


def test_resume_from_an_earlier_checkpoint_replaces_repeated_steps(tmp_path):
    from verl_ext.trace.reader import open_trace

    train(tmp_path, 2, "trainer.save_freq=1")
    trace = open_trace(str(tmp_path / "trace"))
    step1_before = trace.read_step(1).to_pandas()
    written_before = trace.step_record(2).written_at

    resumed = train(
        tmp_path, 3, "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={tmp_path / 'checkpoints' / 'global_step_1'}",
    )  # fmt: skip
    assert sorted(resumed) == [2, 3]  # step 1 came from the checkpoint; 2 and 3 were trained again

    trace = open_trace(str(tmp_path / "trace"))
    assert trace.steps == [1, 2, 3]
    assert trace.read_step(1).to_pandas().equals(step1_before)  # untouched
    assert trace.step_record(2).written_at > written_before  # step 2 was written again
    for step, batch in ((2, resumed[2]), (3, resumed[3])):
        table = trace.read_step(step).to_pandas()
        mask = batch["response_mask"].numpy()
        lengths = [int(np.flatnonzero(row).max()) + 1 if row.any() else 0 for row in mask]
        assert len(table) == sum(lengths)  # one row per position: no duplicates from the first run
        positions = (table["sample"].to_numpy(), table["token_index"].to_numpy())
        np.testing.assert_array_equal(table["return"].to_numpy(np.float32), batch["returns"].numpy()[positions])

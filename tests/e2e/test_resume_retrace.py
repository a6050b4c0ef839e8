"""Checkpoints and resuming, on one save-then-resume pair of verl runs (in process): a traced run of 2
steps saves a checkpoint after each (both the actor's and the critic's weights moved); a second run
resumes from the earlier one, continues from the saved step, and re-traces the steps it repeats: each
such step is replaced by the resumed run's batch, never duplicated, and the earlier steps are kept.

Covers: verl_ext.integration.trace_hook across a resumed fit() (verl's checkpoint and resume),
verl_ext.trace's writer and reader (a repeated step replaced, not duplicated), on the CPU backend
(verl_ext.cpu)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.cpu.helpers import SCENARIOS, read_batches, run
from verl_ext.apps.learning import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def train(out: Path, steps: int, *overrides: str) -> dict:
    command = [
        sys.executable, str(SCENARIOS), "in-process", str(out), "--estimator", "mc", "--steps", str(steps),
        "--config-dir", str(ROOT / "verl_ext" / "configs"), "--config-name", "verl_ext_trainer", "--",
        "trainer.val_before_train=False", "trainer.save_freq=1", f"verl_ext.trace.dir={out / 'trace'}", *overrides,
    ]  # fmt: skip
    run(command, env={**os.environ, "VERL_EXT_CPU": "1"}, cwd=out, timeout=600)
    return read_batches(out)["steps"]


@pytest.fixture(scope="module")
def saved_then_resumed(tmp_path_factory, assets):
    """Two steps saved after each, then 3 steps resumed from step 1's checkpoint; what each saw in between."""
    # its own runs: checkpoints, and a second run that resumes into the first one's trace
    from verl_ext.trace.reader import open_trace

    out = tmp_path_factory.mktemp("resume")
    train(out, 2)
    trace = open_trace(str(out / "trace"))
    first = {
        "latest": (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text(),
        "step1": trace.read_step(1).to_pandas(),
        "step2_written_at": trace.step_record(2).written_at,
    }
    (out / "metrics.jsonl").unlink()  # what the resumed run logs, alone
    resumed = train(
        out, 3, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={out / 'checkpoints' / 'global_step_1'}"
    )
    return out, first, resumed


def _saved_weight(checkpoint: Path, role: str, name: str) -> torch.Tensor:
    state = torch.load(checkpoint / role / "model_world_size_1_rank_0.pt", weights_only=False)
    return state[name].to_local()  # an FSDP2 DTensor on a one-rank mesh: the local shard is the tensor


def test_a_checkpoint_holds_the_trained_actor_and_critic(saved_then_resumed, assets):
    from safetensors.torch import load_file

    out, first, _ = saved_then_resumed
    assert first["latest"] == "2"
    # both the actor and the critic trained: their saved weights moved away from the initial model
    name = "model.layers.0.self_attn.q_proj.weight"
    initial = load_file(assets.model_dir / "model.safetensors")[name]
    for role in ("actor", "critic"):
        assert not torch.equal(_saved_weight(out / "checkpoints" / "global_step_2", role, name), initial), role


def test_resume_continues_from_the_saved_step(saved_then_resumed):
    out, _, resumed = saved_then_resumed
    assert sorted(resumed) == [2, 3]  # step 1 came from the checkpoint; 2 and 3 were trained again
    assert sorted(read_metrics(out)) == [2, 3]
    log = (out / "output.log").read_text()
    assert "Resuming from" in log and "global_step_1" in log
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_resume_from_an_earlier_checkpoint_replaces_repeated_steps(saved_then_resumed):
    from verl_ext.trace.reader import open_trace

    out, first, resumed = saved_then_resumed
    trace = open_trace(str(out / "trace"))
    assert trace.steps == [1, 2, 3]
    assert trace.read_step(1).to_pandas().equals(first["step1"])  # untouched
    assert trace.step_record(2).written_at > first["step2_written_at"]  # step 2 was written again
    for step, batch in ((2, resumed[2]), (3, resumed[3])):
        table = trace.read_step(step).to_pandas()
        mask = batch["response_mask"].numpy()
        lengths = [int(np.flatnonzero(row).max()) + 1 if row.any() else 0 for row in mask]
        assert len(table) == sum(lengths)  # one row per position: no duplicates from the first run
        positions = (table["sample"].to_numpy(), table["token_index"].to_numpy())
        np.testing.assert_array_equal(table["return"].to_numpy(np.float32), batch["returns"].numpy()[positions])

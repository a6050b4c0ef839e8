"""The tool task on Ray with verl 0.9's default V1 trainer (recipes/cpu_demo.sh, ``TASK=tool V1=1``),
its responses from verl's own vLLM server (``ROLLOUT=vllm``: vLLM's CPU build, verl_ext.cpu.vllm_rollout),
``turn_gae`` with per-turn rewards: verl's ToolAgentLoop in a Ray agent-loop worker calling vLLM turn by turn, the agent loop's
record of each sample's turns (and of the turns its tool rewards belong to) carried through
TransferQueue's ``extra_fields``, the calculator's reward on the calling turn's last token before the
estimator runs. Every response is checked against the task's definition (tests/apps/test_tool_demo.py)
and the trace passes the checker, which recomputes turn_gae from the recorded rewards and values.
vLLM's log-probs of the responses agree with the trainer's to < 1e-5 (fp32), and vLLM's own stop reason of
each response's last generation agrees with the trace's EOS rule. (In process, the legacy trainer:
tests/apps/test_tool_demo.py; the legacy trainer on vLLM: tests/e2e/test_vllm_rollout.py.)

Covers: the V1 trainer's seam (verl_ext.integration: patches, agent_turns in the Ray agent-loop
worker, turn_rewards_hook, trace_hook), verl_ext.turn_rewards and verl_ext.turns,
verl_ext.estimators' turn_gae with verl_ext.kernels, verl_ext.trace (capture, agent record, writer,
reader), verl_ext.check.run, the tool task (verl_ext.tasks.tool) and the CPU backend
(verl_ext.cpu, verl_ext.cpu.vllm_rollout) on Ray."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.cpu.helpers import RAY_GROUP

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # one Ray run at a time, on the suite's cluster (tests/conftest.py)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "cpu_demo.sh"


@pytest.fixture(scope="module")
def v1_tool_run(tmp_path_factory, assets_dir, tool_assets, ray_cluster):
    # its own run: the only run of the tool task's agent loop in a Ray worker (V1 trainer), the only V1 run on vLLM
    from tests.cpu.helpers import run

    out = tmp_path_factory.mktemp("v1_tool")
    env = {
        **os.environ, "PYTHON": sys.executable, "OUTPUT_DIR": str(out), "VERL_EXT_CPU_ASSETS": str(assets_dir),
        "TASK": "tool", "V1": "1", "ESTIMATOR": "turn_gae", "ROLLOUT_N": "4", "STEPS": "2", "RAY_ADDRESS": ray_cluster.address,
        "ROLLOUT": "vllm",
    }  # fmt: skip
    overrides = [
        f"+verl_ext.trace.dir={out / 'trace'}",
        "+verl_ext.turn_rewards=true",
        "trainer.val_before_train=False",  # nothing here reads a validation
        "trainer.save_freq=1",  # a checkpoint after every step, for verl-ext replay with the model
        *ray_cluster.v1_overrides,
    ]
    run(["bash", str(RECIPE), *overrides], env, out, timeout=600)
    return out


def test_the_v1_trainer_runs_turn_gae_with_the_tools_rewards_on_their_turns(v1_tool_run):
    from tests.apps.test_tool_demo import count_checked_tool_calls
    from verl_ext.check.run import check_trace
    from verl_ext.trace.reader import open_trace

    assert "(TaskRunnerV1 pid=" in (v1_tool_run / "train.log").read_text()
    trace = open_trace(str(v1_tool_run / "trace"))
    assert trace.record.trainer == "v1" and trace.steps == [1, 2]
    assert trace.record.algorithm["adv_estimator"] == "turn_gae"
    assert count_checked_tool_calls(trace) >= 5  # of 64 responses, about 3 in 10 call
    report = check_trace(trace)
    passed = {r.identity for r in report.identities if r.status == "pass"}
    assert report.passed and {"advantage_raw", "returns", "rewards", "turn_rewards", "turns", "roles", "stop_reason"} <= passed
    # vLLM made the responses, turn by turn: its log-probs are the trainer's (fp32), and it said why each ended
    assert trace.record.rollout["name"] == "vllm"
    for step in trace.steps:
        table = trace.read_step(step, ["mask", "old_log_prob", "rollout_log_prob"]).to_pandas()
        valid = table[table["mask"]]
        assert (valid["rollout_log_prob"] - valid["old_log_prob"]).abs().max() < 1e-5
        assert trace.prompts(step).column("stop_reason").null_count == 0
    # the step's live metric: the tool rewards placed, per response, as the trace has them
    metrics = [json.loads(line) for line in (v1_tool_run / "metrics.jsonl").read_text().splitlines()]
    for step in trace.steps:
        placed = trace.read_step(step, ["tool_reward"]).column("tool_reward").to_numpy()
        logged = next(m["data"] for m in metrics if m["step"] == step and "verl_ext/turn_rewards/tool_reward" in m["data"])
        logged = logged["verl_ext/turn_rewards/tool_reward"]
        assert logged == pytest.approx(placed.sum() / trace.prompts(step).num_rows, rel=1e-5) and logged > 0


def test_a_tool_step_replays_as_recorded_and_with_another_estimator(v1_tool_run, tmp_path, capsys):
    """``verl-ext replay`` on a tool-task step of the V1 trainer (holes where the tool answered): with the
    model, from verl's checkpoint of step 1, the whole update and the parameters after it are REPRODUCED,
    and with mc instead of turn_gae the replay's trace passes the checker."""
    from verl_ext.cli import main

    trace = str(v1_tool_run / "trace")
    assert main(["replay", trace, "--step", "2", "--out", str(tmp_path / "as_recorded")]) == 0
    assert "with the model" in capsys.readouterr().out
    assert main(["check", str(tmp_path / "as_recorded"), "--quiet"]) == 0
    assert main(["replay", trace, "--step", "2", "--out", str(tmp_path / "mc"), "--", "algorithm.adv_estimator=mc"]) == 0
    assert main(["check", str(tmp_path / "mc"), "--quiet"]) == 0

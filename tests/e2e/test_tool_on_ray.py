"""The tool task on Ray with verl 0.9's default V1 trainer (recipes/cpu_demo.sh, ``TASK=tool V1=1``),
its responses from verl's own vLLM server (``ROLLOUT=vllm``: vLLM's CPU build, verl_ext.cpu.vllm_rollout),
with per-turn rewards: verl's ToolAgentLoop in a Ray agent-loop worker calling vLLM turn by turn, the agent loop's
record of each sample's turns (and of the turns its tool rewards belong to) carried through
TransferQueue's ``extra_fields``, the calculator's reward on the calling turn's last token before the
estimator runs. Every response is checked against the task's definition (tests/apps/test_tool_demo.py)
and the trace passes the checker, which recomputes the run's estimator from the recorded rewards and values
and holds the turns, the roles, the turn rewards and the stop reasons; ``turn_gae`` on the run's step 2 through
``verl-ext replay`` with the model, its trace checked (turn_gae recomputed). vLLM's log-probs of the responses
agree with a float64 forward pass of the weights that generated them to within float32's rounding, and vLLM's own stop reason of each
response's last generation agrees with the trace's EOS rule. (In process, the legacy trainer:
tests/apps/test_tool_demo.py; the legacy trainer on vLLM: tests/e2e/test_vllm_rollout.py.)

The run is the suite's one V1 run (tests/e2e/v1_run.py, the ``v1_run`` fixture of tests/e2e/conftest.py), which
tests/e2e/test_v1_trace.py reads too (issue 55: they were two runs). Against this file's own earlier run it
trains the README's ``td_half`` instead of ``turn_gae`` (the user's estimator of test_v1_trace.py; turn_gae
runs in the replay below), in bf16 (verl's GPU settings) with vLLM in fp32, with the KL in the reward, verl's
rollout correction and responses cut at the length limit: the tests say what each holds instead.

Covers: the V1 trainer's seam (verl_ext.integration: patches, agent_turns in the Ray agent-loop
worker, turn_rewards_hook, trace_hook), verl_ext.turn_rewards and verl_ext.turns,
verl_ext.estimators' turn_gae with verl_ext.kernels (in the replay), verl_ext.trace (capture, agent record, writer,
reader), verl_ext.check.run, the tool task (verl_ext.tasks.tool) and the CPU backend
(verl_ext.cpu, verl_ext.cpu.vllm_rollout) on Ray."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.cpu.helpers import RAY_GROUP
from tests.e2e.v1_run import KL_COEF
from tests.support.tolerances import assert_within

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # one Ray run at a time, on the suite's cluster (tests/conftest.py)


def check_json(trace: Path, run: Path) -> dict:
    """``verl-ext check --json`` on ``trace`` with the run's user module importable (the estimator it trained)."""
    from tests.e2e.test_fit_with_trace import user_module_env

    result = subprocess.run(
        [sys.executable, "-m", "verl_ext.cli", "check", str(trace), "--json"],
        capture_output=True, text=True, env={**os.environ, **user_module_env(run)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout)


def exact_log_probs(run: Path, step: int, prompt_ids: list[int], response_ids: list[int], cache: dict) -> tuple[np.ndarray, np.ndarray]:
    """The log-prob of each response token under the weights that generated it, by the test's own float64
    forward pass of transformers' model, and the float32 rounding an fp32 engine may add to it
    (tests/support/tolerances.forward_pass): step 1's responses came from the model's initial weights, step n's
    from those after step n − 1, verl's checkpoint of that step (its actor's one-rank FSDP state, float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.e2e.gpu_world import composed_config
    from tests.support.tolerances import forward_pass

    if step not in cache:
        path = composed_config(run)["actor_rollout_ref"]["model"]["path"]
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        if step > 1:
            saved = run / "checkpoints" / f"global_step_{step - 1}" / "actor" / "model_world_size_1_rank_0.pt"
            state = torch.load(saved, map_location="cpu", weights_only=False)
            model.load_state_dict({name: (value.to_local() if hasattr(value, "to_local") else value).double() for name, value in state.items()})
        cache[step] = model.eval()
    model = cache[step]
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + response_ids])).logits[0, len(prompt_ids) - 1 : -1]
    log_probs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids)[:, None])[:, 0].numpy()
    positions = np.arange(len(prompt_ids) - 1, len(prompt_ids) + len(response_ids) - 1)
    return log_probs, forward_pass(logits.numpy(), positions, model.config)


def test_the_v1_trainer_runs_the_tool_task_with_the_tools_rewards_on_their_turns(v1_run):
    """As before the merge, but: the responses' rewards hold the KL (β·kl, verl's kl_penalty) and the tokens verl's
    rejection took out are the policy's, not holes (count_checked_tool_calls' kl_coef and rejected); check runs as a
    command with the user's module importable (the run's estimator is td_half, not turn_gae: the replay below); vLLM's
    log-probs are held to the test's own float64 forward pass of the same weights, within an fp32 forward pass's
    rounding (tests/support/tolerances.forward_pass: the worst token measured at 0.05 of it, a bf16 model 12 times
    and stale weights 600 times over it), instead of the trainer's old log-probs (the trainer computes in bf16 now:
    those differ by bf16's rounding, which the rollout correction acts on, tests/e2e/test_v1_trace.py). A fixed
    1e-5 failed once: a token at position 32 of its sequence, 1.5e-5 off (130 ε of its log-prob, −3.8)."""
    from tests.apps.test_tool_demo import count_checked_tool_calls
    from verl_ext.trace.reader import open_trace

    assert "(TaskRunnerV1 pid=" in (v1_run / "train.log").read_text()
    trace = open_trace(str(v1_run / "trace"))
    assert trace.record.trainer == "v1" and trace.steps == [1, 2]
    assert trace.record.algorithm["adv_estimator"] == "td_half"
    assert count_checked_tool_calls(trace, kl_coef=KL_COEF) >= 5  # of 64 responses, about 3 in 10 call
    report = check_json(v1_run / "trace", v1_run)
    passed = {r["identity"] for r in report["identities"] if r["status"] == "pass"}
    assert report["passed"] and {"advantage_raw", "returns", "rewards", "turn_rewards", "turns", "roles", "stop_reason"} <= passed
    # vLLM made the responses, turn by turn: its log-probs are the policy's (fp32), and it said why each ended
    assert trace.record.rollout["name"] == "vllm"
    models = {}
    for step in trace.steps:
        table = trace.read_step(step, ["sample", "token_index", "token_id", "mask", "rejected", "rollout_log_prob"]).to_pandas()
        prompts = trace.prompts(step).to_pandas().set_index("sample")
        for sample, rows in table.groupby("sample"):
            rows = rows.sort_values("token_index")
            exact, rounding = exact_log_probs(v1_run, step, list(prompts.at[sample, "prompt_token_ids"]), rows["token_id"].tolist(), models)
            policys = rows["mask"].to_numpy() | rows["rejected"].fillna(False).to_numpy(bool)  # kept or rejected
            assert_within(rows["rollout_log_prob"].to_numpy()[policys], exact[policys], rounding[policys], f"step {step}, sample {sample}")
        assert trace.prompts(step).column("stop_reason").null_count == 0
    # the step's live metric: the tool rewards placed, per response, as the trace has them
    metrics = [json.loads(line) for line in (v1_run / "metrics.jsonl").read_text().splitlines()]
    for step in trace.steps:
        placed = trace.read_step(step, ["tool_reward"]).column("tool_reward").to_numpy()
        logged = next(m["data"] for m in metrics if m["step"] == step and "verl_ext/turn_rewards/tool_reward" in m["data"])
        logged = logged["verl_ext/turn_rewards/tool_reward"]
        assert logged == pytest.approx(placed.sum() / trace.prompts(step).num_rows, rel=1e-5) and logged > 0


def test_a_tool_step_replays_with_turn_gae(v1_run, tmp_path):
    """``verl-ext replay`` on a tool-task step of the V1 trainer (holes where the tool answered) with turn_gae
    instead of the run's estimator: with the model, from verl's checkpoint of step 1, and the replay's trace
    passes the checker, turn_gae's returns and advantages recomputed from the recorded rewards and values, its
    turns and turn rewards held. (As recorded, the same step is REPRODUCED with the model and model-free:
    tests/e2e/test_v1_trace.py, one model replay for both files; this what-if was mc instead of turn_gae when
    the run trained turn_gae.)"""
    from tests.e2e.test_fit_with_trace import user_module_env
    from verl_ext.trace.reader import open_trace

    out = tmp_path / "turn_gae"
    result = subprocess.run(
        [sys.executable, "-m", "verl_ext.cli", "replay", str(v1_run / "trace"), "--step", "2", "--out", str(out), "--", "algorithm.adv_estimator=turn_gae"],
        capture_output=True, text=True, env={**os.environ, **user_module_env(v1_run)},
    )  # fmt: skip
    assert result.returncode == 0 and "with the model" in result.stdout, result.stdout + result.stderr
    assert open_trace(str(out)).record.algorithm["adv_estimator"] == "turn_gae"
    report = check_json(out, v1_run)
    statuses = {r["identity"]: r["status"] for r in report["identities"]}
    assert report["passed"] and {statuses[key] for key in ("advantage_raw", "returns", "turn_rewards", "turns", "roles")} == {"pass"}

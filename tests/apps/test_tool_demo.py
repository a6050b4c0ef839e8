"""``verl-ext demo --task tool --turn-rewards``, a few steps: verl's own tool agent loop on the HF
rollout server, the calculator called through verl's hermes parser, its reward for a well-formed call
on the calling turn's last token, the trace checked, shown and viewed.

The run's responses are checked against what the task's definition says independently of the code
under test: the question's numbers are read back from the prompt text, a call's from the call text,
and the tool's message, the turns, the score and the tool's reward follow from those by hand."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.apps.conftest import TOOL_DEMO_GROUP
from tests.apps.conftest import TOOL_DEMO_STEPS as STEPS

pytestmark = pytest.mark.xdist_group(TOOL_DEMO_GROUP)  # the run is shared with test_readme_commands.py

QUESTION = re.compile(r"请问(\d+)\+(\d+)=(\d+)？")
CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)  # verl's hermes parser's


@pytest.fixture
def demo(tool_demo):
    return tool_demo  # tests/apps/conftest.py


def test_the_demo_passes_check_and_reports_the_tool_call_rate(demo):
    out, stdout = demo
    assert "PASS" in stdout and "tool calls" in stdout
    assert re.search(r"step +1 .*tool calls +\d+%", stdout) and re.search(rf"step +{STEPS} .*tool calls", stdout)
    # the response shown token by token called the tool, and its header shows the tool's message inline
    assert re.search(r"response: <tool_call>.*</tool_call></s>⟦<\|tool\|><tool_response>\d+</tool_response><\|assistant\|>⟧等于", stdout)
    assert re.search(rf"held-out accuracy .*: [\d.]+ before training, [\d.]+ after step {STEPS}", stdout)
    assert (out / "view.html").stat().st_size > 0


def test_every_response_is_what_the_tool_agent_loop_makes_of_the_policys_turns(demo):
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(demo[0] / "trace"))
    assert trace.steps == list(range(1, STEPS + 1))
    assert count_checked_tool_calls(trace) >= 10  # the warm start calls about 3 times in 10: ~115 of 384


def count_checked_tool_calls(trace, kl_coef: float | None = None) -> int:
    """Check every response of ``trace`` (a run of the tool task with per-turn rewards placed:
    verl_ext.turn_rewards) against the task's definition; return how many called the tool. ``kl_coef``: the
    run's β where it put the KL in the reward (None: it did not). The tokens verl's rollout correction
    rejected (the trace's ``rejected``: mask 0) are the policy's, not holes (tests/e2e/test_tool_on_ray.py)."""
    import torch
    from verl.trainer.ppo.core_algos import kl_penalty

    from verl_ext.tasks.tool.assets import build_tool_tokenizer

    tokenizer = build_tool_tokenizer()
    length_limit = trace.record.config["data"]["max_response_length"]
    calls = 0
    for step in trace.steps:
        columns = ["sample", "token_index", "token_id", "mask", "rejected", "turn", "role", "score", "reward", "kl", "turn_score", "tool_reward"]
        tokens = trace.read_step(step, [*columns, "old_log_prob", "ref_log_prob"]).to_pandas()
        prompts = trace.prompts(step).to_pandas().set_index("sample")
        for sample, rows in tokens.groupby("sample"):
            rows = rows.sort_values("token_index")
            tool_reward = [0.0] * len(rows)  # by hand: the calculator's 0.1 for a call with integer arguments
            a, b, c = map(int, QUESTION.search(tokenizer.decode(prompts.at[sample, "prompt_token_ids"])).groups())
            policys = rows["mask"].to_numpy() | rows["rejected"].fillna(False).to_numpy(bool)  # kept or rejected
            holes = rows[~policys]
            if len(holes):
                calls += 1
                # the first turn ends with EOS and holds a call as verl's hermes parser reads it (the first
                # <tool_call>…</tool_call>, JSON); right after it, the mask-0 tokens: the calculator's answer
                # to that call (its numbers as the policy wrote them) and the next assistant header
                call_turn = rows["token_id"].tolist().index(tokenizer.eos_token_id) + 1
                call = json.loads(CALL.search(tokenizer.decode(rows["token_id"].tolist()[:call_turn])).group(1))
                assert call["name"] == "add"
                tool_reward[call_turn - 1] = call_reward(call["arguments"])
                assert holes["token_index"].tolist() == list(range(call_turn, call_turn + len(holes)))
                assert tokenizer.decode(holes["token_id"].tolist()) == tool_message(call["arguments"])
                answer_turn = call_turn + len(holes)
                assert rows["turn"].tolist() == [0] * answer_turn + [1] * (len(rows) - answer_turn)
                assert prompts.at[sample, "assistant_turns"] == 2 and prompts.at[sample, "tool_calls"] == 1
                # the tool's message is the tool's; the model's tokens are the assistant's
                assert set(holes["role"]) == {"tool"} and set(rows[policys]["role"]) == {"assistant"}
                # max_assistant_turns=2: the second turn ends the response; at the turn limit if it calls again, unless
                # the response reached the length limit: verl's loop checks the length first (a second call that ends
                # at the 26th token of tests/e2e/v1_run.py's responses stopped there, once in several runs)
                second_call = CALL.search(tokenizer.decode(rows["token_id"].tolist()[answer_turn:]))
                calls_again = second_call is not None and _parses(second_call.group(1))
                assert prompts.at[sample, "turn_limit"] == (calls_again and prompts.at[sample, "response_length"] < length_limit)
            else:
                assert prompts.at[sample, "assistant_turns"] == 1 and set(rows["turn"]) == {0}
                assert set(rows["role"]) == {"assistant"} and prompts.at[sample, "tool_calls"] == 0
                assert not prompts.at[sample, "turn_limit"]
                # a call in a turn that ended below the length limit whose answer would not fit: verl's loop calls
                # the tool (its reward kept) and then ends the response without the tool's message (the length
                # check after ToolAgentLoop._handle_processing_tools_state's merge); seen once in several V1 runs
                call = CALL.search(tokenizer.decode(rows["token_id"].tolist()))
                if len(rows) < length_limit and call is not None and _parses(call.group(1)):
                    call = json.loads(call.group(1))
                    assert call["name"] == "add"
                    arguments = call["arguments"]
                    if {"a", "b"} <= set(arguments):  # else the tool's answer is verl's error message, reward 0
                        assert len(rows) + len(tokenizer.encode(tool_message(arguments), add_special_tokens=False)) >= length_limit
                    tool_reward[-1] = call_reward(arguments)
            # the reward: on the last token, of what follows the last </tool_response> in the response as
            # verl decodes it for the reward (special tokens removed): 1.0 for exactly the expected
            # answer, else 0.2 per right part
            answer = tokenizer.decode(rows["token_id"].tolist(), skip_special_tokens=True).split("</tool_response>")[-1]
            expected_sum, verdict = f"等于{a + b}，", "是的" if a + b == c else "不是"
            if answer == f"{expected_sum}{verdict}！":
                score = 1.0
            else:
                score = 0.2 * answer.startswith(expected_sum) + 0.2 * ("，" in answer and answer.partition("，")[2][:2] == verdict)
            assert rows["score"].iloc[-1] == pytest.approx(score) and (rows["score"].iloc[:-1] == 0).all()
            # the calculator's reward on the calling turn's last token; verl's own tool agent loop fills
            # no turn scores; the rewards are the score plus the tool's, less β·kl where the run put the KL in them,
            # kl verl's own kl_penalty of the old and reference log-probs
            assert rows["tool_reward"].tolist() == pytest.approx(tool_reward) and (rows["turn_score"] == 0).all()
            valid = rows["mask"].to_numpy()
            expected_reward = (rows["score"] + rows["tool_reward"]).to_numpy()[valid]
            if kl_coef is None:
                assert rows["kl"].isna().all()
                assert rows["reward"].to_numpy()[valid] == pytest.approx(expected_reward, abs=1e-7)
                continue
            old, reference = (torch.from_numpy(rows[name].to_numpy(np.float64)[valid]) for name in ("old_log_prob", "ref_log_prob"))
            kl, recorded = kl_penalty(old, reference, kl_penalty="kl").numpy(), rows["kl"].to_numpy(np.float64)[valid]
            # the run that puts the KL in the reward trains in bf16 (tests/e2e/v1_run.py): its trainer rounds kl and
            # β·kl to bf16 (unit roundoff 2⁻⁸), and adds in float32 (docs/definitions.md#tolerances)
            assert (np.abs(recorded - kl) <= 2.0**-8 * np.abs(kl)).all()
            terms = np.abs(expected_reward) + np.abs(kl_coef * recorded)
            bound = 1e-6 + 2.0**-8 * np.abs(kl_coef * recorded) + 4 * np.finfo(np.float32).eps * terms
            assert (np.abs(rows["reward"].to_numpy()[valid] - (expected_reward - kl_coef * recorded)) <= bound).all()
    return calls


def tool_message(arguments: dict) -> str:
    """What verl merges into the response after a call to add: the calculator's answer (the sum of the numbers as
    the policy wrote them) in the tool's message, and the next assistant header."""
    return f"<|tool|><tool_response>{int(arguments['a']) + int(arguments['b'])}</tool_response><|assistant|>"


def call_reward(arguments: dict) -> float:
    """The calculator's reward of a call, by hand: 0.1 when both arguments are integers in the call's JSON."""
    return 0.1 if all(type(arguments.get(name)) is int for name in "ab") else 0.0


def _parses(call: str) -> bool:
    """verl's hermes parser takes a call whose text is JSON with a name and arguments."""
    try:
        parsed = json.loads(call)
    except json.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and {"name", "arguments"} <= set(parsed)


def test_the_tool_call_rate_and_the_call_decisions_share_by_hand(demo):
    """The demo's credit line on the tool task: the share of responses whose first token is <tool_call>,
    and the first tokens' share of Σ|A|, counted here from the trace's rows."""
    from verl_ext.apps.credit import step_credit
    from verl_ext.tasks.tool.assets import build_tool_tokenizer
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(demo[0] / "trace"))
    call = build_tool_tokenizer().convert_tokens_to_ids("<tool_call>")
    for step in trace.steps:
        rows = trace.read_step(step, ["sample", "token_index", "token_id", "mask", "advantage"]).to_pandas()
        valid = rows[rows["mask"]]
        first = valid[valid["token_index"] == 0]
        credit = step_credit(trace, step, task="tool")
        assert credit.call_rate == pytest.approx((first["token_id"] == call).mean(), abs=1e-12)
        assert credit.decision_share == pytest.approx(first["advantage"].abs().sum() / valid["advantage"].abs().sum(), rel=1e-6)


def test_the_credit_by_turn_is_each_estimator_by_hand(demo):
    """The demo's credit by turn at the last step: turn_gae at the recipe's λ = 0, mc, gae_ext
    (λ_critic 1, λ_actor 0.95) and grpo, computed here response by response from the trace's
    rewards, values, turns and prompt groups (γ = 1; a hole is skipped: the next state is the next
    written token), then their shares of Σ|A|, as the demo prints them.

    Both sides compute in float64 from the trace's float32 numbers, so they differ by float64's
    rounding only, bounded by the rules of docs/definitions.md#tolerances with float64's ε: 4ε·|A| +
    ε·L·m for the sums over a response (m its largest |r|, |V|, |A|, L its length), and grpo's
    (G − mean)/(std + 1e-6) moves by the error of its sums over the group's std, as whitening does."""
    from verl_ext.apps.credit import turn_advantages
    from verl_ext.trace.reader import open_trace

    out, stdout = demo
    trace = open_trace(str(out / "trace"))
    step = trace.steps[-1]
    rows = trace.read_step(step, ["sample", "token_index", "mask", "turn", "reward", "value"]).to_pandas()
    rows[["reward", "value"]] = rows[["reward", "value"]].astype(np.float64)  # float32 as stored: computed in float64
    uid = trace.prompts(step).to_pandas().set_index("sample")["uid"]
    valid = rows[rows["mask"]].sort_values(["sample", "token_index"])
    by_hand = {"turn_gae λ=0": [], "mc": [], "gae_ext": [], "grpo": []}
    tolerance = {label: [] for label in by_hand}
    eps = float(np.finfo(np.float64).eps)
    returns = valid.groupby("sample")["reward"].sum()
    lengths = valid.groupby("sample").size()
    for sample, response in valid.groupby("sample", sort=True):
        r, v, turn = response["reward"].to_numpy(), response["value"].to_numpy(), response["turn"].to_numpy()
        turns = sorted(set(turn))
        v_start = [v[turn == k][0] for k in turns] + [0.0]
        by_hand["turn_gae λ=0"] += [r[turn == k].sum() + v_start[i + 1] - v_start[i] for i, k in enumerate(turns) for _ in range((turn == k).sum())]
        by_hand["mc"] += list(np.cumsum(r[::-1])[::-1] - v)
        delta = r + np.append(v[1:], 0.0) - v
        gae, running = np.zeros(len(r)), 0.0
        for t in reversed(range(len(r))):
            running = delta[t] + 0.95 * running
            gae[t] = running
        by_hand["gae_ext"] += list(gae)
        group = returns[[s for s in returns.index if uid[s] == uid[sample]]]
        scale = group.std(ddof=1) + 1e-6
        grpo = (returns[sample] - group.mean()) / scale
        by_hand["grpo"] += [grpo] * len(r)
        m = max(np.abs(r).max(), np.abs(v).max(), np.abs(r).sum() + np.abs(v).max())  # |A| ≤ Σ|r| + max|V|
        for label in ("turn_gae λ=0", "mc", "gae_ext"):
            tolerance[label] += list(4 * eps * np.abs(by_hand[label][-len(r):]) + eps * len(r) * m)
        # the group's sums of up to L_max rewards each, their mean and std: the error of a sum over the scale
        sums_error = eps * lengths[group.index].max() * np.abs(valid[valid["sample"].isin(group.index)]["reward"]).max()
        tolerance["grpo"] += [16 * eps * (abs(grpo) + (abs(returns[sample]) + abs(group.mean())) / scale) + 4 * sums_error / scale] * len(r)
    advantages = turn_advantages(trace, step, "tool")
    assert list(advantages.by_estimator) == list(by_hand)
    for label, expected in by_hand.items():
        np.testing.assert_array_less(np.abs(advantages.by_estimator[label] - np.array(expected)), np.array(tolerance[label]), err_msg=label)
    # the printed table: each estimator's share of Σ|A| on turn 0 and turn 1, from the sums by hand
    for label, expected in by_hand.items():
        magnitude = np.abs(np.array(expected))
        shares = [magnitude[valid["turn"].to_numpy() == k].sum() / magnitude.sum() for k in (0, 1)]
        assert re.search(rf"{re.escape(label)} +\d\.\d\d +\d\.\d\d +{shares[0]:.2f} +{shares[1]:.2f}", stdout), label


def test_the_documented_accuracy_before_training_is_the_runs(demo):
    """docs/tasks.md's held-out accuracy before the tool demo trains (seed 0: the warm start's seeded
    validation, which the per-turn rewards and the step count do not touch) is in the range documented
    over the machines measured, to its rounding; and it is what the demo printed."""
    from tests.apps.conftest import DOCUMENTED_ROUNDING, documented_before
    from verl_ext.apps.learning import read_metrics, validation_accuracy

    before = validation_accuracy(read_metrics(demo[0]))[0]
    low, high = documented_before("`verl-ext demo --task tool --rollout hf_generate` (seed 0)")
    assert low - DOCUMENTED_ROUNDING <= before <= high + DOCUMENTED_ROUNDING
    assert re.search(rf"held-out accuracy .*: {before:.3f} before training", demo[1])


def test_the_study_reads_a_tool_run_with_its_calls_and_credit_by_turn(demo):
    """`verl-ext study --task tool` reads each run as it reads this one: the calls made per step are
    the responses with a hole (the tool's answer), counted here; the turn metrics are verl's logged
    ones; the summary has the tool's columns."""
    from verl_ext.apps.learning import read_metrics
    from verl_ext.apps.study import RunResult, StudySettings, _read_run, summary_markdown
    from verl_ext.trace.reader import open_trace

    out = demo[0]
    result = _read_run("turn_gae", "pretrained", 0, 1.0, out, "tool")
    trace, metrics = open_trace(str(out / "trace")), read_metrics(out)
    by_step = {row["step"]: row for row in result.rows}
    assert sorted(by_step) == [0, *trace.steps]
    for step in trace.steps:
        rows = trace.read_step(step, ["sample", "mask"]).to_pandas()
        with_hole = rows.groupby("sample")["mask"].apply(lambda mask: not mask.all())
        assert by_step[step]["calls_made"] == pytest.approx(with_hole.mean(), abs=1e-12)
        assert by_step[step]["share_turn1"] == metrics[step].get("verl_ext/credit/share/turn1")
        assert by_step[step]["ev_after_hole"] == metrics[step].get("verl_ext/critic/ev_mc/after_hole")
    summary = summary_markdown([RunResult("turn_gae", "pretrained", 0, 1.0, result.rows)], StudySettings(STEPS, STEPS, 0.8, "tool"))
    assert "# Estimator study on the tool task" in summary and "starts a call / calls made (last step)" in summary
    (line,) = [line for line in summary.splitlines() if line.startswith("| turn_gae ")]
    assert f"{by_step[STEPS]['call_start']:.2f} / {by_step[STEPS]['calls_made']:.2f}" in line

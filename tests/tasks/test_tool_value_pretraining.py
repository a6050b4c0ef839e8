"""The tool task's value pretraining (verl_ext.tasks.tool.value_pretraining): its rollouts are what
verl's tool agent loop makes of the policy's turns, checked against the task's definition by hand
(the call's numbers read back from the call text, the tool's message and the turns from those); the
states it measures the critic at; verl's error texts; the ceiling's formula; the cached critic."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from verl_ext.tasks.tool.value_pretraining import RolloutLimits, ev_ceiling, rollouts, tool_text

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)  # verl's hermes parser's
LIMITS = RolloutLimits(prompt_length=20, response_length=32)


@pytest.fixture(scope="module")
def warm_start(tool_assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_assets.model_dir)
    return AutoModelForCausalLM.from_pretrained(tool_assets.model_dir, dtype=torch.float32).eval(), tokenizer


def test_rollouts_are_what_the_tool_agent_loop_makes_of_the_policys_turns(warm_start):
    from verl_ext.tasks.arith.warm_start import prompt_ids
    from verl_ext.tasks.tool.assets import AssetSpec
    from verl_ext.tasks.tool.task import problem_sets, score_solution

    policy, tokenizer = warm_start
    spec = AssetSpec()
    problems = problem_sets(spec.seed, spec.digits, spec.max_delta, 10, 16).val
    scored, calls = rollouts(policy, tokenizer, problems, samples=4, seed=0, limits=LIMITS)
    eos, comma = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("，")
    called = 0
    assert len(scored.rows) == 64
    for i, (prompt, response, mask) in enumerate(scored.rows):
        problem = problems[i // 4]
        assert prompt == prompt_ids(tokenizer, problem) and 1 <= len(response) <= 32 and len(mask) == len(response)
        first_turn = response.index(eos) + 1 if eos in response else len(response)
        found = CALL.search(tokenizer.decode(response[:first_turn]))
        hole = [t for t, m in enumerate(mask) if m == 0.0]
        if found and first_turn < 32:
            call = json.loads(found.group(1))
            assert call["name"] == "add"  # the warm start writes no other name here
            message = f"<|tool|><tool_response>{int(call['arguments']['a']) + int(call['arguments']['b'])}</tool_response><|assistant|>"
            # the tool's message follows the call turn, mask 0, then the second turn (mask 1) up to EOS or the length limit
            assert tokenizer.decode(response[first_turn : first_turn + len(hole)]) == message
            assert hole == list(range(first_turn, first_turn + len(hole)))
            second = response[first_turn + len(hole) :]
            assert (eos in second and second.index(eos) == len(second) - 1) or len(response) == 32
            assert scored.states["after_tool"][i] == [first_turn + len(hole)]
            called += 1
        else:
            assert hole == [] and first_turn == len(response) and scored.states["after_tool"][i] == []
        assert scored.scores[i] == score_solution(tokenizer.decode(response, skip_special_tokens=True), problem.answer()).score
        assert scored.states["first_token"][i] == [0]
        assert scored.states["after_decision"][i] == ([1] if len(response) > 1 else [])
        assert scored.states["written"][i] == [t for t in range(len(response)) if t not in hole]
        after_comma = response.index(comma) + 1 if comma in response else None
        verdict = after_comma if after_comma is not None and after_comma < len(response) and response[after_comma] != eos else None
        assert scored.states["after_verdict"][i] == ([] if verdict is None else list(range(verdict + 1, len(response))))
    assert called >= 5  # the warm start calls about 3 times in 10
    assert calls["tool_answered"] == pytest.approx(called / 64, abs=1e-4)
    assert rollouts(policy, tokenizer, problems, samples=4, seed=0, limits=LIMITS)[0].rows == scored.rows  # seeded


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        ('{"name":"add","arguments":{"a":37,"b":48}}', "85"),
        ('{"name":"add","arguments":{"a":"37","b":48}}', "85"),  # the calculator's int(); its reward is 0 then
        # verl's texts, cut on the right at 16 characters as verl cuts them
        ('{"name":"mul","arguments":{"a":1,"b":2}}', "Unknown function...(truncated)"),
        ('{"name":"add","arguments":{"a":1}}', "Error executing ...(truncated)"),
        ("not json", ""),
    ],
)
def test_the_tools_answer_to_a_call(call, expected):
    assert tool_text(call, 16) == expected


def test_the_ceiling_is_the_share_of_the_returns_variance_between_states():
    # two states, four returns each
    returns = [[1.0, 1.0, 0.2, 0.2], [0.0, 0.0, 0.2, 0.2]]
    within = np.mean([np.var([1.0, 1.0, 0.2, 0.2], ddof=1), np.var([0.0, 0.0, 0.2, 0.2], ddof=1)])
    total = np.var([1.0, 1.0, 0.2, 0.2, 0.0, 0.0, 0.2, 0.2], ddof=1)
    assert ev_ceiling(returns) == pytest.approx(1 - within / total, rel=1e-12)
    assert ev_ceiling([[1.0, 1.0], [0.0, 0.0]]) == pytest.approx(1.0)  # each state decides its return
    assert ev_ceiling([[0.2, 0.2], [0.2, 0.2]]) is None


def test_the_cached_critic_is_verls_critic_with_its_report(tool_assets):
    from transformers import AutoModelForTokenClassification

    critic = AutoModelForTokenClassification.from_pretrained(tool_assets.critic_dir, dtype=torch.float32)
    assert critic.config.num_labels == 1
    report = json.loads(tool_assets.value_pretraining_report.read_text())
    fit = report["held_out_fit"]
    assert set(fit) == {"ev_first_token", "ev_after_decision", "ev_after_tool", "ev_after_verdict", "ev_written", "mean_abs_error"}
    assert report["held_out_fit_per_epoch"][report["best_epoch"]] == fit
    # what it learned: a call is worth more than answering at once, as the returns say
    paths = report["after_decision"]
    assert paths["call"]["mean_return"] > paths["answer"]["mean_return"] and paths["call"]["mean_value"] > paths["answer"]["mean_value"]
    assert fit["ev_after_tool"] <= report["ev_ceiling_after_tool"] + 0.05

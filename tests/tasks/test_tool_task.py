"""The tool task: its problems, the calculator as verl loads it, the tokenizer and template as verl's
tool agent loop uses them, the warm start's examples against verl's own token builder, the reward."""

from __future__ import annotations

import asyncio
import random

import pytest

from verl_ext.tasks.arith.task import Problem
from verl_ext.tasks.tool.assets import TOOLS_FILE, build_tool_tokenizer
from verl_ext.tasks.tool.reward import compute_score
from verl_ext.tasks.tool.task import call_text, problem_sets
from verl_ext.tasks.tool.warm_start import example

CALL = '<tool_call>{"name":"add","arguments":{"a":123,"b":456}}</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    return build_tool_tokenizer()


def test_problems_have_the_digits_asked_and_held_out_pairs_stay_out_of_training():
    sets = problem_sets(seed=0, digits=3, max_delta=3, n_train=4000, n_val=60)
    assert all(100 <= n <= 999 for p in sets.train + sets.val for n in (p.a, p.b))
    assert not {(p.a, p.b) for p in sets.train} & {(p.a, p.b) for p in sets.val}
    assert [p.right for p in sets.val[:4]] == [True, False, True, False] and sum(p.right for p in sets.val) == 30
    assert all(1 <= abs(p.c - p.a - p.b) <= 3 for p in sets.train + sets.val if not p.right)


def test_the_call_round_trips_through_the_tokenizer_and_verls_hermes_parser(tokenizer):
    from verl.experimental.agent_loop.tool_parser import ToolParser

    assert call_text(Problem(123, 456, 580)) == CALL
    ids = tokenizer.encode(CALL, add_special_tokens=False)
    assert len(ids) == 11 and tokenizer.decode(ids) == CALL  # 8 fixed tokens and 6 digits... less the 3 joined pieces
    parser = ToolParser.get_tool_parser("hermes", tokenizer)
    _, calls = asyncio.run(parser.extract_tool_calls(ids + [tokenizer.eos_token_id]))
    assert [(c.name, c.arguments) for c in calls] == [("add", '{"a": 123, "b": 456}')]


def test_verl_loads_the_calculator_by_path_and_calls_it():
    from verl.tools.function_tool import load_function_tools_from_path

    (tool,) = load_function_tools_from_path(str(TOOLS_FILE))
    assert tool.name == "add"
    assert tool.tool_schema.function.parameters.required == ["a", "b"]
    # the answer and the reward of a well-formed call (integers), none for a string argument
    assert asyncio.run(tool.call({"a": 123, "b": 456})) == ("579", 0.1)
    assert asyncio.run(tool.call({"a": 123, "b": "456"})) == ("579", 0.0)


def run_verls_token_builder(tokenizer, p: Problem, written: list[list[int]]):
    """What verl's ContinuousTokenBuilder makes of a conversation: the user's question, then the
    model's turns ``written`` with the calculator's answer between them, as ToolAgentLoop merges them."""
    from verl.utils.tokenizer.continuous_token import ContinuousTokenBuilder

    builder = ContinuousTokenBuilder(tokenizer)
    messages = [{"role": "user", "content": p.question()}]
    tokens = builder.build_initial_tokens(messages, tools=[{"type": "function", "function": {"name": "add"}}])
    prompt, mask = list(tokens), []
    for turn, ids in enumerate(written):
        if turn:
            updated = messages + [{"role": "tool", "content": str(p.a + p.b)}]
            merge = builder.merge_context_tokens(messages, updated, tokens)
            messages = updated
        else:
            merge = None
        for result in ([merge] if merge else []) + [builder.merge_assistant_tokens(tokens if merge is None else merge.token_ids, ids)]:
            mask, _ = builder.align_response_metadata(result, mask)
            tokens = result.token_ids
        messages = messages + [{"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}]
    return prompt, tokens[len(prompt) :], mask


@pytest.mark.parametrize("use_tool", [True, False], ids=["tool path", "head path"])
@pytest.mark.parametrize("right_verdict", [True, False], ids=["right verdict", "wrong verdict"])
def test_warm_start_examples_are_what_verls_tool_agent_loop_builds(tokenizer, use_tool, right_verdict):
    p = Problem(123, 456, random.Random(0).choice([579, 580]))
    prompt, response, mask = example(tokenizer, p, use_tool, right_verdict)
    written = [response[: mask.index(0.0)], response[mask.index(0.0) + mask.count(0.0) :]] if use_tool else [response]
    expected_prompt, expected_response, expected_mask = run_verls_token_builder(tokenizer, p, written)
    assert (prompt, response, mask) == (expected_prompt, expected_response, [float(m) for m in expected_mask])
    text = tokenizer.decode(response, skip_special_tokens=True)
    verdict = p.right == right_verdict
    assert text == (CALL + "<tool_response>579</tool_response>" if use_tool else "") + f"等于579，{'是的' if verdict else '不是'}！"
    if use_tool:  # the tool's message and the next assistant header: 7 tokens the policy did not write
        assert tokenizer.convert_ids_to_tokens([t for t, m in zip(response, mask) if not m]) == [
            "<|tool|>", "<tool_response>", "5", "7", "9", "</tool_response>", "<|assistant|>"
        ]


@pytest.mark.parametrize(
    "solution, score, acc",
    [
        (CALL + "<tool_response>579</tool_response>等于579，是的！", 1.0, 1.0),
        ("等于579，是的！", 1.0, 1.0),  # no call: scored as it is
        (CALL + "<tool_response>579</tool_response>等于579，不是！", 0.2, 0.0),  # right sum, wrong verdict
        (CALL + "<tool_response>579</tool_response>等于578，是的！", 0.2, 0.0),  # wrong sum, right verdict
        (CALL, 0.0, 0.0),  # a call that got no answer (the turn limit): nothing after it
        ("<tool_response>579</tool_response>", 0.0, 0.0),
    ],
)
def test_the_reward_scores_the_answer_after_the_tools_message(solution, score, acc):
    assert compute_score("verl_ext/sum_check_tool", solution, "等于579，是的！") == {"score": score, "acc": acc}

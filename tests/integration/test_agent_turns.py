"""The record of who wrote each response token (verl_ext.integration.agent_turns), on verl's real
ToolAgentLoop driven by a scripted server: each ending of the loop, with the roles, tool calls, turn
limit and the turns of the tool rewards it should give, worked out by hand from the script (the
calculator rewards a well-formed call with TOOL_CALL_REWARD)."""

from __future__ import annotations

import asyncio

import pytest

from verl_ext.tasks.arith.task import Problem
from verl_ext.tasks.tool.assets import TOOLS_FILE, build_tool_tokenizer
from verl_ext.tasks.tool.calculator import TOOL_CALL_REWARD
from verl_ext.tasks.tool.task import call_text

PROBLEM = Problem(37, 48, 86)
#: The tool's message for a call of add(37, 48), and the next assistant header: 6 tokens, mask 0.
TOOL_MESSAGE = "<|tool|><tool_response>85</tool_response><|assistant|>"


class ScriptedServer:
    """Answers the loop's generate calls with the scripted turns, in order."""

    def __init__(self, turns: list[list[int]]):
        self.turns = list(turns)

    async def generate(self, request_id, prompt_ids, sampling_params, **unused):
        from verl.workers.rollout.replica import TokenOutput

        ids = self.turns.pop(0)
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tool_tokenizer()


def tool_loop(compose, tokenizer, turns, traced=True, turn_rewards=False, response_length=32, max_assistant_turns=2):
    import hydra
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.tools.function_tool import load_function_tools_from_path

    from verl_ext.integration.plugin import activate

    activate()
    config = compose(
        f"data.max_response_length={response_length}",
        "data.max_prompt_length=20",
        "actor_rollout_ref.rollout.multi_turn.format=hermes",
        f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={max_assistant_turns}",
        *(["verl_ext.trace.dir=/nonexistent/never-written"] if traced else []),
        *(["verl_ext.turn_rewards=true"] if turn_rewards else []),
    )
    return hydra.utils.instantiate(
        config=_agent_loop_registry["tool_agent"],
        trainer_config=DictConfigWrap(config=config),
        server_manager=ScriptedServer(turns),
        tokenizer=tokenizer,
        processor=None,
        dataset_cls=None,
        data_config=DictConfigWrap(config.data),
        tools=ToolListWrap(load_function_tools_from_path(str(TOOLS_FILE))),
    )


def run(compose, tokenizer, turns, **settings):
    """verl's ToolAgentLoop on one prompt, built inside the event loop that runs it (it keeps that loop)."""

    async def one_sample():
        loop = tool_loop(compose, tokenizer, turns, **settings)
        return await loop.run({"temperature": 1.0}, raw_prompt=[{"role": "user", "content": PROBLEM.question()}])

    return asyncio.run(one_sample())


def ids(tokenizer, text: str, eos: bool = True) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if eos else [])


def record(output) -> dict:
    from verl_ext.integration.agent_turns import TURNS_KEY

    return output.extra_fields[TURNS_KEY]


def test_an_answer_without_a_call_is_one_assistant_run(compose, tokenizer):
    answer = ids(tokenizer, PROBLEM.answer())
    output = run(compose, tokenizer, [answer])
    assert output.response_ids == answer
    assert record(output) == {"roles": [["assistant", 9]], "tool_calls": 0, "turn_limit": False, "tool_reward_turns": []}
    assert output.extra_fields["tool_rewards"] == []


def test_a_call_then_an_answer(compose, tokenizer):
    call, answer = ids(tokenizer, call_text(PROBLEM)), ids(tokenizer, PROBLEM.answer())
    output = run(compose, tokenizer, [call, answer])
    message = ids(tokenizer, TOOL_MESSAGE, eos=False)
    assert output.response_ids == call + message + answer and len(message) == 6
    assert output.response_mask == [1] * 10 + [0] * 6 + [1] * 9  # a call of 10 tokens, an answer of 9
    # the second turn reached max_assistant_turns=2, but asked for no tool: not a turn-limit end
    assert record(output) == {
        "roles": [["assistant", 10], ["tool", 6], ["assistant", 9]], "tool_calls": 1, "turn_limit": False, "tool_reward_turns": [0]
    }  # fmt: skip
    assert output.extra_fields["tool_rewards"] == [TOOL_CALL_REWARD]


def test_two_calls_in_two_turns_earn_a_reward_each_on_their_own_turn(compose, tokenizer):
    call, answer = ids(tokenizer, call_text(PROBLEM)), ids(tokenizer, PROBLEM.answer())
    output = run(compose, tokenizer, [call, call, answer], max_assistant_turns=3, response_length=48)
    assert output.response_mask == [1] * 10 + [0] * 6 + [1] * 10 + [0] * 6 + [1] * 9
    assert record(output)["tool_calls"] == 2 and record(output)["tool_reward_turns"] == [0, 1]
    assert output.extra_fields["tool_rewards"] == [TOOL_CALL_REWARD, TOOL_CALL_REWARD]


def test_a_second_call_ends_at_the_turn_limit(compose, tokenizer):
    call = ids(tokenizer, call_text(PROBLEM))
    output = run(compose, tokenizer, [call, call])
    # the second call is never made: the loop stops at the limit before it runs tools
    assert record(output) == {
        "roles": [["assistant", 10], ["tool", 6], ["assistant", 10]], "tool_calls": 1, "turn_limit": True, "tool_reward_turns": [0]
    }  # fmt: skip
    assert output.extra_fields["tool_rewards"] == [TOOL_CALL_REWARD]


def test_a_tool_message_that_does_not_fit_is_left_out(compose, tokenizer):
    """verl computes the merge, finds it would reach the response length and drops it (the response
    ends on the call): the record follows the response, not the merge. The call was made, and its
    reward belongs to the turn that made it."""
    call = ids(tokenizer, call_text(PROBLEM))
    output = run(compose, tokenizer, [call], response_length=14)
    assert output.response_ids == call and output.response_mask == [1] * 10
    assert record(output) == {"roles": [["assistant", 10]], "tool_calls": 0, "turn_limit": False, "tool_reward_turns": [0]}
    assert output.extra_fields["tool_rewards"] == [TOOL_CALL_REWARD]


def test_an_answer_cut_at_the_response_length_is_not_a_turn_limit_end(compose, tokenizer):
    call = ids(tokenizer, call_text(PROBLEM))
    output = run(compose, tokenizer, [call, call], response_length=20)
    assert output.response_mask == [1] * 10 + [0] * 6 + [1] * 4  # the second call cut after 4 tokens
    assert record(output) == {
        "roles": [["assistant", 10], ["tool", 6], ["assistant", 4]], "tool_calls": 1, "turn_limit": False, "tool_reward_turns": [0]
    }  # fmt: skip


@pytest.mark.parametrize(
    "appended, role",
    [(["tool"], "tool"), (["tool", "tool"], "tool"), (["user"], "user"), (["tool", "user"], "other"), (["system"], "other")],
)
def test_appended_messages_keep_their_role_when_they_share_one(appended, role):
    from verl_ext.integration.agent_turns import appended_role

    previous = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert appended_role(previous, previous + [{"role": r, "content": "x"} for r in appended]) == role


def test_an_untraced_run_records_nothing(compose, tokenizer):
    from verl_ext.integration.agent_turns import TURNS_KEY

    output = run(compose, tokenizer, [ids(tokenizer, PROBLEM.answer())], traced=False)
    assert TURNS_KEY not in output.extra_fields


def test_an_untraced_run_with_turn_rewards_records(compose, tokenizer):
    call, answer = ids(tokenizer, call_text(PROBLEM)), ids(tokenizer, PROBLEM.answer())
    output = run(compose, tokenizer, [call, answer], traced=False, turn_rewards=True)
    assert record(output)["tool_reward_turns"] == [0]

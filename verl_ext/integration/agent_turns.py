"""Who wrote each token of a multi-turn response, from the merges verl's agent loop itself makes.

verl's output says only which response tokens the model generated (``response_mask`` 1); a mask-0
token may be a tool's answer, a user message, a chat-template marker or a boundary token a
model-specific builder inserted. The agent loop knows: every token it adds goes through one of
two Continuous-Token merges (``AgentLoopBase.ct_merge_assistant_token`` for the model's tokens,
``ct_merge_context_msg`` for appended messages, whose roles it is given). The wrappers here record
each merge's role and length as the loop makes it, unchanged; the wrapped ``ToolAgentLoop.run``
opens one record per sample (a ``ContextVar``: every sample runs in its own asyncio task), cuts it
to the response verl returns, and puts it in the sample's ``extra_fields`` under :data:`TURNS_KEY`, as
:class:`~verl_ext.trace.agent_record.AgentRecord` encodes it::

    {"roles": [["assistant", 12], ["tool", 7], ["assistant", 10]], "tool_calls": 1, "turn_limit": False,
     "tool_reward_turns": [0]}

verl carries ``extra_fields`` to the trainer's batch (legacy: one object column per key; V1: the
``extra_fields`` field), where the trace (:mod:`verl_ext.trace.capture`) and the per-turn
rewards (:mod:`verl_ext.integration.turn_rewards_hook`) read it. Only runs that trace
(``verl_ext.trace``) or place per-turn rewards (``verl_ext.turn_rewards``) record: any other batch has
no extra column.

* ``roles``: runs of (role, tokens) covering the response: ``assistant`` for merged model tokens,
  ``tool`` or ``user`` for appended messages of that one role, ``other`` for inserted boundary
  tokens and any other or mixed group. The tokens a context merge appends include the message's
  template markers and, when the builder fuses it, the next assistant header.
* ``tool_calls``: tool messages merged into the response (a call whose merge verl threw away
  because it would not fit is not counted: its tokens are not in the response).
* ``turn_limit``: the loop stopped because ``max_assistant_turns`` or ``max_user_turns`` was
  reached while the last turn still asked for a tool (verl's own parser on that turn), following
  ``ToolAgentLoop._handle_generating_state``'s order: the length check first, then the limits.
* ``tool_reward_turns``: the assistant turn (docs/definitions.md §7) whose call earned each entry of
  the loop's own ``extra_fields["tool_rewards"]``, in order: the turn before the tool messages of
  each context merge, the merge verl threw away included (its call was made and rewarded). None when
  the loop's rewards do not pair one to one with its tool messages (a tool that returned no reward).

The record is dropped (None) when it does not cover the response exactly or disagrees with its mask
(a loop that adds tokens some other way); the trace then leaves the roles of the mask-0 tokens null.

Each generation's reply also passes through ``LLMServerClient.generate`` while the sample's record is
open: the sample's :data:`~verl_ext.integration.stop_reasons.STOP_REASON_KEY` becomes its last
generation's (verl keeps the first generation's ``extra_fields`` only).
"""

from __future__ import annotations

import contextvars
import functools
import logging
from typing import Any, Callable

from verl_ext.integration.stop_reasons import STOP_REASON_KEY
from verl_ext.trace.agent_record import AgentRecord
from verl_ext.trace.schema import ROLE_ASSISTANT, ROLE_OTHER, ROLE_TOOL, ROLE_USER

logger = logging.getLogger("verl_ext")

#: The ``extra_fields`` key of the record (and the legacy batch's non-tensor column).
TURNS_KEY = "verl_ext_turns"
#: Roles a group of appended messages keeps as it is; any other role, or a mix, is ``other``.
MESSAGE_ROLES = (ROLE_TOOL, ROLE_USER)

_unpaired_said = False
_RECORD: contextvars.ContextVar["_Record | None"] = contextvars.ContextVar("verl_ext_agent_turns", default=None)


class _Record:
    """The merges of one sample, in order: (role, tokens, tool messages, kind); and for every merge of
    tool messages, the turn that called (the turn of the last assistant token so far) and how many."""

    def __init__(self):
        self.merges: list[tuple[str, int, int, str]] = []
        self.tool_rounds: list[tuple[int, int]] = []
        self.stop_reasons: list[str | None] = []  # each generation's, where the server gave one

    def calling_turn(self) -> int:
        """The turn of the last assistant token merged so far: the holes before it."""
        turn, in_hole = -1, True
        for role, size, _, _ in self.merges:
            if size and role == ROLE_ASSISTANT and in_hole:
                turn += 1
            if size:
                in_hole = role != ROLE_ASSISTANT
        return turn

    def add(self, merge_result: Any, role: str, tool_messages: int = 0) -> None:
        if merge_result.removed_prefix_token_count:
            self._trim(merge_result.removed_prefix_token_count)
        if merge_result.inserted_token_ids:
            self.merges.append((ROLE_OTHER, len(merge_result.inserted_token_ids), 0, "inserted"))
        self.merges.append((role, merge_result.appended_token_count, tool_messages, merge_result.kind))

    def _trim(self, count: int) -> None:
        while count and self.merges:
            role, length, tools, kind = self.merges.pop()
            if length > count:
                self.merges.append((role, length - count, tools, kind))
            count = max(0, count - length)

    def cut(self, length: int) -> list[tuple[str, int, int, str]]:
        """The merges that make up the first ``length`` response tokens (the last one cut short)."""
        kept, start = [], 0
        for role, size, tools, kind in self.merges:
            if start >= length:
                break
            kept.append((role, min(size, length - start), tools, kind))
            start += size
        return kept


def appended_role(previous_messages: list[dict], updated_messages: list[dict]) -> str:
    """The role of the messages a context merge appends: theirs when they share one of
    :data:`MESSAGE_ROLES`, else ``other``."""
    roles = {message.get("role") for message in updated_messages[len(previous_messages) :]}
    return roles.pop() if len(roles) == 1 and roles <= set(MESSAGE_ROLES) else ROLE_OTHER


def wrap_ct_merge_assistant_token(original: Callable) -> Callable:
    @functools.wraps(original)
    async def ct_merge_assistant_token(self, *args, **kwargs):
        merged = await original(self, *args, **kwargs)
        record = _RECORD.get()
        if record is not None:
            record.add(merged[0], ROLE_ASSISTANT)
        return merged

    return ct_merge_assistant_token


def wrap_ct_merge_context_msg(original: Callable) -> Callable:
    @functools.wraps(original)
    async def ct_merge_context_msg(self, previous_messages, updated_messages, *args, **kwargs):
        merged = await original(self, previous_messages, updated_messages, *args, **kwargs)
        record = _RECORD.get()
        if record is not None:
            appended = updated_messages[len(previous_messages) :]
            tools = sum(message.get("role") == ROLE_TOOL for message in appended)
            if tools:
                record.tool_rounds.append((record.calling_turn(), tools))
            record.add(merged[0], appended_role(previous_messages, updated_messages), tools)
        return merged

    return ct_merge_context_msg


def wrap_server_client_generate(original: Callable) -> Callable:
    @functools.wraps(original)
    async def generate(self, *args, **kwargs):
        output = await original(self, *args, **kwargs)
        record = _RECORD.get()
        if record is not None and STOP_REASON_KEY in (output.extra_fields or {}):
            record.stop_reasons.append(output.extra_fields[STOP_REASON_KEY])
        return output

    return generate


def wrap_agent_loop_run(original: Callable) -> Callable:
    @functools.wraps(original)
    async def run(self, sampling_params, *args, **kwargs):
        if not _recorded(self.config):
            return await original(self, sampling_params, *args, **kwargs)
        record = _Record()
        token = _RECORD.set(record)
        try:
            output = await original(self, sampling_params, *args, **kwargs)
        finally:
            _RECORD.reset(token)
        output.extra_fields[TURNS_KEY] = await _summary(self, record, output)
        if record.stop_reasons:
            output.extra_fields[STOP_REASON_KEY] = record.stop_reasons[-1]
        return output

    return run


async def _summary(loop: Any, record: _Record, output: Any) -> dict | None:
    """The encoded record of a finished sample (module docstring), or None when it does not match its response."""
    mask = list(output.response_mask)
    merges = record.cut(len(mask))
    expanded = [role == ROLE_ASSISTANT for role, size, _, _ in merges for _ in range(size)]
    if expanded != [bool(m) for m in mask]:
        logger.warning("verl-ext: the agent loop's merges do not match a response's mask; its tokens' roles are not recorded")
        return None
    roles: list[list] = []
    for role, size, _, _ in merges:
        if roles and roles[-1][0] == role:
            roles[-1][1] += size
        else:
            roles.append([role, size])
    turns = _tool_reward_turns(record, output)
    return AgentRecord(
        roles=tuple((role, size) for role, size in roles),
        tool_calls=sum(tools for _, _, tools, _ in merges),
        turn_limit=await _stopped_at_turn_limit(loop, merges, output),
        tool_reward_turns=None if turns is None else tuple(turns),
    ).encode()


def _tool_reward_turns(record: _Record, output: Any) -> list[int] | None:
    turns = [turn for turn, tools in record.tool_rounds for _ in range(tools)]
    rewards = output.extra_fields.get("tool_rewards")
    if rewards is None or len(rewards) != len(turns):
        global _unpaired_said
        if not _unpaired_said:
            _unpaired_said = True
            logger.warning(
                "verl-ext: a sample's tool rewards (%s) do not pair with its %d tool messages; such rewards are not "
                "placed on turns (said once)", "none" if rewards is None else len(rewards), len(turns),
            )  # fmt: skip
        return None
    return turns


async def _stopped_at_turn_limit(loop: Any, merges: list[tuple[str, int, int, str]], output: Any) -> bool:
    assistant_turns = sum(kind == "assistant" for _, _, _, kind in merges)
    tool_rounds = sum(tools > 0 for _, _, tools, _ in merges)
    max_assistant, max_user = getattr(loop, "max_assistant_turns", None), getattr(loop, "max_user_turns", None)
    parser = getattr(loop, "tool_parser", None)
    if not merges or merges[-1][3] != "assistant" or parser is None or len(output.response_mask) >= loop.response_length:
        return False  # the last merge was not the model's, or the loop stopped at the length limit
    if not ((max_assistant and assistant_turns >= max_assistant) or (max_user and tool_rounds >= max_user)):
        return False
    last_turn = list(output.response_ids)[len(output.response_ids) - merges[-1][1] :]
    tools = [tool.tool_schema for tool in getattr(loop, "tools", {}).values()]
    _, calls = await parser.extract_tool_calls(last_turn, tools)
    return bool(calls)


def _recorded(config: Any) -> bool:
    from verl_ext.options import TraceOptions, turn_rewards_enabled

    return TraceOptions.from_config(config).enabled or turn_rewards_enabled(config)

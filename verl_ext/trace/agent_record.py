"""The agent loop's record of one sample's response: who wrote each token, its tool calls, whether
the turn limit ended it, and the turn whose call earned each tool reward.

:mod:`verl_ext.integration.agent_turns` makes it in the agent loop; it travels to the trainer in the
sample's ``extra_fields`` as the plain dict :meth:`AgentRecord.encode` makes (Ray and TransferQueue
carry Python builtins, and a run's outputs may keep it), and the trace's capture and the per-turn
rewards read it back with :meth:`AgentRecord.decode`. Those two are the only places its keys are
written. The meaning of each field: :mod:`verl_ext.integration.agent_turns`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from verl_ext.trace.schema import ROLE_ASSISTANT, ROLE_CODES

#: ``role``'s code for the policy's own tokens, as the token table stores codes (an index into ROLE_CODES).
ASSISTANT_CODE = ROLE_CODES.index(ROLE_ASSISTANT)


@dataclass(frozen=True)
class AgentRecord:
    """One sample's record; a field is None where the record does not say."""

    #: runs of (role, tokens) covering the response, in order
    roles: tuple[tuple[str, int], ...] = ()
    tool_calls: int | None = None
    turn_limit: bool | None = None
    #: the assistant turn of each of the loop's tool rewards; None when they do not pair with its tool messages
    tool_reward_turns: tuple[int, ...] | None = None

    def encode(self) -> dict[str, Any]:
        return {
            "roles": [[role, count] for role, count in self.roles],
            "tool_calls": self.tool_calls,
            "turn_limit": self.turn_limit,
            "tool_reward_turns": None if self.tool_reward_turns is None else list(self.tool_reward_turns),
        }

    @classmethod
    def decode(cls, value: Mapping[str, Any] | AgentRecord | None) -> AgentRecord | None:
        """The record :meth:`encode` wrote, or None for a sample without one (None, an empty dict)."""
        if isinstance(value, AgentRecord):
            return value
        if not value or not isinstance(value, Mapping):
            return None
        tool_calls, turn_limit, turns = value.get("tool_calls"), value.get("turn_limit"), value.get("tool_reward_turns")
        return cls(
            roles=tuple((str(role), int(count)) for role, count in value.get("roles") or ()),
            tool_calls=None if tool_calls is None else int(tool_calls),
            turn_limit=None if turn_limit is None else bool(turn_limit),
            tool_reward_turns=None if turns is None else tuple(int(turn) for turn in turns),
        )

    def role_codes(self) -> np.ndarray:
        """(tokens the record covers,) int8: each token's role as an index into ROLE_CODES, −1 for a
        role the trace does not know."""
        index = {name: code for code, name in enumerate(ROLE_CODES)}
        codes = np.array([index.get(role, -1) for role, _ in self.roles], np.int8)
        return np.repeat(codes, [count for _, count in self.roles])

"""The per-turn rewards (``verl_ext.turn_rewards``, docs/definitions.md §7) on verl's batch.

verl 0.9.1's agent loops return per-turn scores in each sample's ``extra_fields``, ``turn_scores``
(one per assistant turn, in order; verl's own loops leave it empty) and ``tool_rewards`` (one per
tool call), and verl puts only the final score into the token rewards. With ``verl_ext.turn_rewards``
on, the advantage step (:func:`verl_ext.integration.step.advantage`) adds each
to ``token_level_rewards`` at its turn's last token (:func:`verl_ext.turn_rewards.place_turn_rewards`)
before any estimator, verl's or verl-ext's, runs. Which turn earned a tool reward is in the agent
loop's record (:class:`~verl_ext.trace.agent_record.AgentRecord`, which the loop writes whenever this
option is on).

The legacy batch has the three as non-tensor columns; the V1 batch does not, so the V1 step reads the
samples' ``extra_fields`` from TransferQueue first (:func:`sources`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl_ext.integration.agent_turns import TURNS_KEY
from verl_ext.trace.agent_record import AgentRecord

#: The keys of a sample's ``extra_fields`` (legacy: the batch's non-tensor columns) read here.
SOURCE_KEYS = ("turn_scores", "tool_rewards", TURNS_KEY)


@dataclass(frozen=True)
class PlacedTurnRewards:
    """What :func:`place` added to a batch's rewards, by source, (B, T) each; the rewards with them; and
    the step's metrics of them."""

    turn_score: torch.Tensor
    tool_reward: torch.Tensor
    rewards: torch.Tensor
    metrics: dict[str, float]


def sources(data: Any, extra_fields: list | None = None) -> tuple[list, list, list]:
    """Per row: turn scores, tool rewards, the agent loop's record (empty lists and None where absent);
    from the samples' ``extra_fields`` where given (V1), else from the batch's non-tensor columns."""
    rows = len(data.batch["response_mask"])
    if extra_fields is not None:
        fields = [e if isinstance(e, dict) else {} for e in extra_fields]
        columns = {key: [e.get(key) for e in fields] for key in SOURCE_KEYS}
    else:
        columns = {key: data.non_tensor_batch.get(key) for key in SOURCE_KEYS}
    turn_scores, tool_rewards, records = (list(columns[key]) if columns[key] is not None else [None] * rows for key in SOURCE_KEYS)
    return turn_scores, tool_rewards, records


def place(data: Any, turn_scores: list, tool_rewards: list, records: list, own_mask: Any = None) -> PlacedTurnRewards:
    """Add the rows' per-turn rewards to the batch's ``token_level_rewards``, each on its turn's last token.
    The turns are the policy's tokens' (docs/definitions.md#off-policy-tokens): ``own_mask``, the response mask
    before verl's rollout correction rejected tokens from it, where it did (a rejected token is not a hole: on the
    mask after the rejection one inside a turn split it, and the turn's reward landed before it)."""
    from verl_ext.turn_rewards import place_turn_rewards

    mask = data.batch["response_mask"] if own_mask is None else own_mask
    turn_score, unplaced_scores = place_turn_rewards(mask, [list(enumerate(_floats(s))) for s in turn_scores])
    by_turn, unpaired = [], 0
    for rewards, encoded in zip(tool_rewards, records):
        record = AgentRecord.decode(encoded)
        turns = None if record is None else record.tool_reward_turns
        rewards = _floats(rewards)
        if turns is None or len(turns) != len(rewards):
            unpaired += len(rewards)
            by_turn.append([])
        else:
            by_turn.append(list(zip(turns, rewards)))
    tool_reward, unplaced_tools = place_turn_rewards(mask, by_turn)
    rewards = data.batch["token_level_rewards"]  # a new tensor: without KL it is the scores' own
    data.batch["token_level_rewards"] = rewards + (turn_score + tool_reward).to(rewards.dtype)
    responses = max(len(mask), 1)
    metrics = {
        "verl_ext/turn_rewards/turn_score": float(turn_score.sum(dtype=torch.float64)) / responses,
        "verl_ext/turn_rewards/tool_reward": float(tool_reward.sum(dtype=torch.float64)) / responses,
        "verl_ext/turn_rewards/unplaced": float(unplaced_scores + unplaced_tools + unpaired),
    }
    return PlacedTurnRewards(turn_score, tool_reward, data.batch["token_level_rewards"], metrics)


def _floats(values: Any) -> list[float]:
    return [] if values is None else [float(x) for x in values]

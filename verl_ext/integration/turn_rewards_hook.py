"""Where verl's trainers meet the per-turn rewards (``verl_ext.turn_rewards``, docs/definitions.md §10).

verl 0.9.1's agent loops return per-turn scores in each sample's ``extra_fields``, ``turn_scores``
(one per assistant turn, in order; verl's own loops leave it empty) and ``tool_rewards`` (one per
tool call), and verl puts only the final score into the token rewards. With ``verl_ext.turn_rewards``
on, the seam at ``compute_advantage`` adds each to ``token_level_rewards`` at its turn's last token
(:func:`verl_ext.turn_rewards.place_turn_rewards`) before any estimator, verl's or verl-ext's, runs.
Which turn earned a tool reward is in the agent loop's record (:mod:`.agent_turns`, which records
whenever this option is on).

* ``session(trainer)`` around ``fit()``: the run's option.
* ``place(data)`` in ``compute_advantage``: the legacy batch has the three as non-tensor columns; the
  V1 batch does not, so ``before_v1_advantage`` reads the samples' ``extra_fields`` from
  TransferQueue before V1's ``_compute_advantage``, and ``after_v1_advantage`` writes the rewards the
  estimator used back after it where verl would not (it stores ``token_level_rewards`` only with KL
  in the reward).

The placed rewards go to the trace (``turn_score``, ``tool_reward``) and to the live metrics
(``verl_ext/turn_rewards/*``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from verl_ext.integration.agent_turns import TURNS_KEY
from verl_ext.options import turn_rewards_enabled

#: The keys of a sample's ``extra_fields`` (legacy: the batch's non-tensor columns) read here.
SOURCE_KEYS = ("turn_scores", "tool_rewards", TURNS_KEY)

_enabled = False
#: V1: the step's samples' extra_fields, read before verl computes its advantages.
_v1_extra_fields: list | None = None
#: V1: the step's response masks (nested, as TransferQueue holds them).
_v1_mask: Any = None
#: V1: the rewards the estimator used, once placed (written back to TransferQueue).
_placed_rewards: Any = None


@contextlib.contextmanager
def session(trainer: Any) -> Iterator[None]:
    global _enabled, _v1_extra_fields, _v1_mask, _placed_rewards
    outer, _enabled = _enabled, turn_rewards_enabled(trainer.config)
    try:
        yield
    finally:
        _enabled, _v1_extra_fields, _v1_mask, _placed_rewards = outer, None, None, None


def place(data: Any) -> dict[str, float]:
    """Add the batch's per-turn rewards to its ``token_level_rewards``; the step's metrics of them."""
    global _placed_rewards
    if not _enabled:
        return {}
    import torch

    from verl_ext.integration import trace_hook
    from verl_ext.turn_rewards import place_turn_rewards

    turn_scores, tool_rewards, records = _sources(data)
    mask = data.batch["response_mask"]
    turn_score, unplaced_scores = place_turn_rewards(mask, [list(enumerate(_floats(s))) for s in turn_scores])
    by_turn, unpaired = [], 0
    for rewards, record in zip(tool_rewards, records):
        turns = record.get("tool_reward_turns") if isinstance(record, dict) else None
        rewards = _floats(rewards)
        if turns is None or len(turns) != len(rewards):
            unpaired += len(rewards)
            by_turn.append([])
        else:
            by_turn.append(list(zip(turns, rewards)))
    tool_reward, unplaced_tools = place_turn_rewards(mask, by_turn)
    rewards = data.batch["token_level_rewards"]  # a new tensor: without KL it is the scores' own
    data.batch["token_level_rewards"] = rewards + (turn_score + tool_reward).to(rewards.dtype)
    if _v1_mask is not None:  # V1 keeps no batch between its calls: written back by after_v1_advantage
        _placed_rewards = data.batch["token_level_rewards"]
    trace_hook.record_turn_rewards(turn_score=turn_score, tool_reward=tool_reward)
    responses = max(len(mask), 1)
    return {
        "verl_ext/turn_rewards/turn_score": float(turn_score.sum(dtype=torch.float64)) / responses,
        "verl_ext/turn_rewards/tool_reward": float(tool_reward.sum(dtype=torch.float64)) / responses,
        "verl_ext/turn_rewards/unplaced": float(unplaced_scores + unplaced_tools + unpaired),
    }


def _sources(data: Any) -> tuple[list, list, list]:
    """Per row: turn scores, tool rewards, the agent loop's record (empty lists and None where absent)."""
    rows = len(data.batch["response_mask"])
    if _v1_extra_fields is not None:
        fields = [e if isinstance(e, dict) else {} for e in _v1_extra_fields]
        columns = {key: [e.get(key) for e in fields] for key in SOURCE_KEYS}
    else:
        columns = {key: data.non_tensor_batch.get(key) for key in SOURCE_KEYS}
    turn_scores, tool_rewards, records = (list(columns[key]) if columns[key] is not None else [None] * rows for key in SOURCE_KEYS)
    return turn_scores, tool_rewards, records


def _floats(values: Any) -> list[float]:
    return [] if values is None else [float(x) for x in values]


def before_v1_advantage(batch_meta: Any) -> None:
    """Before V1's ``_compute_advantage``: read its samples' extra_fields (and masks) for :func:`place`."""
    global _v1_extra_fields, _v1_mask, _placed_rewards
    _v1_extra_fields = _v1_mask = _placed_rewards = None
    if not _enabled or batch_meta.fields is None or "extra_fields" not in batch_meta.fields:
        return
    import transfer_queue as tq

    stored = tq.kv_batch_get(keys=batch_meta.keys, partition_id=batch_meta.partition_id, select_fields=["extra_fields", "response_mask"])
    _v1_extra_fields, _v1_mask = stored.pop("extra_fields").tolist(), stored["response_mask"]


def after_v1_advantage(trainer: Any, batch_meta: Any) -> Any:
    """After V1's ``_compute_advantage``: the batch meta, with the rewards the estimator used written
    to TransferQueue where verl did not write them (no KL in the reward)."""
    global _v1_extra_fields, _v1_mask, _placed_rewards
    placed, mask = _placed_rewards, _v1_mask
    _v1_extra_fields = _v1_mask = _placed_rewards = None
    if placed is None or mask is None or trainer.config.algorithm.use_kl_in_reward:
        return batch_meta
    import transfer_queue as tq
    from tensordict import TensorDict
    from verl.workers.utils.padding import response_to_nested

    rewards = TensorDict({"token_level_rewards": response_to_nested(placed, mask)}, batch_size=len(batch_meta.keys))
    return tq.kv_batch_put(keys=batch_meta.keys, partition_id=batch_meta.partition_id, fields=rewards)

"""Per-turn rewards (docs/definitions.md §7): a score given to assistant turn k of a response is
added to the reward of turn k's last token, before any estimator runs.

An assistant turn is a maximal run of valid tokens (:mod:`verl_ext.turns`); turn k's last token is
the valid token of that run whose successor is masked or past the end. Pure: tensors and lists in,
tensors out; where the scores come from (verl's ``turn_scores`` and ``tool_rewards``) is
:mod:`verl_ext.integration.turn_rewards_hook`'s business.
"""

from __future__ import annotations

from typing import Sequence

import torch

from verl_ext.turns import turn_ends, turn_index, turn_starts


def place_turn_rewards(mask: torch.Tensor, rewards: Sequence[Sequence[tuple[int, float]]]) -> tuple[torch.Tensor, int]:
    """r_t = Σ of the rewards (k, x) of row b whose turn k ends at t: (B, T), B lists -> ((B, T) float32, unplaced).

    ``rewards[b]`` lists row b's rewards as (turn k, value); several may name one turn (they add up).
    A reward whose turn the row does not have (k ≥ K_b, or k < 0) lands nowhere and is counted in
    ``unplaced``.
    """
    if len(rewards) != mask.shape[0]:
        raise ValueError(f"one list of turn rewards per row: got {len(rewards)} for {mask.shape[0]} rows")
    starts = turn_starts(mask)
    placed = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = [b for b, row in enumerate(rewards) for _ in row]
    if not rows:
        return placed, 0
    row = torch.tensor(rows, device=mask.device)
    turn = torch.tensor([int(k) for r in rewards for k, _ in r], device=mask.device)
    value = torch.tensor([float(x) for r in rewards for _, x in r], dtype=torch.float32, device=mask.device)
    turns_per_row = starts.sum(-1)
    known = (turn >= 0) & (turn < turns_per_row[row])
    per_turn = torch.zeros(mask.shape[0], int(turns_per_row.max()) + 1, dtype=torch.float32, device=mask.device)
    per_turn.index_put_((row[known], turn[known]), value[known], accumulate=True)
    ends = turn_ends(mask)
    end_rows, end_positions = ends.nonzero(as_tuple=True)
    placed[end_rows, end_positions] = per_turn[end_rows, turn_index(starts)[end_rows, end_positions]]
    return placed, int((~known).sum())

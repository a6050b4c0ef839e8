"""Per-turn rewards placed on their turns' last tokens (verl_ext.turn_rewards, docs/definitions.md §7),
by hand. The seam that hands them over from verl's agent loop: tests/integration/test_turn_rewards_seam.py."""

from __future__ import annotations

import pytest
import torch

from verl_ext.turn_rewards import place_turn_rewards
from verl_ext.turns import turn_ends


def test_turn_ends_and_placement_by_hand():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    assert turn_ends(mask).int().tolist() == [[0, 1, 0, 0, 0, 1, 0], [0, 0, 1, 0, 0, 0, 0], [0] * 7]
    rewards = [[(0, 0.1), (1, 0.5), (0, 0.2)], [(0, 1.0), (1, 2.0), (-1, 4.0)], [(0, 3.0)]]
    placed, unplaced = place_turn_rewards(mask, rewards)
    expected = torch.zeros(3, 7)
    expected[0, 1], expected[0, 5], expected[1, 2] = 0.1 + 0.2, 0.5, 1.0
    torch.testing.assert_close(placed, expected)
    assert unplaced == 3  # row 1's turns 1 and -1, row 2 has no turn
    assert place_turn_rewards(mask, [[], [], []])[0].abs().sum() == 0
    with pytest.raises(ValueError, match="one list of turn rewards per row"):
        place_turn_rewards(mask, [[]])


def test_a_turn_after_leading_masked_tokens_gets_its_reward_on_its_last_token():
    """Row 0 begins with two masked tokens: its turn 0 is tokens 2-3, turn 1 token 5; row 1 is one turn
    to the end of the row. A reward of turn k lands on turn k's last token only."""
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1]])
    placed, unplaced = place_turn_rewards(mask, [[(1, 0.25), (0, 0.5)], [(0, 2.0), (1, 7.0)]])
    expected = torch.zeros(2, 6)
    expected[0, 3], expected[0, 5], expected[1, 5] = 0.5, 0.25, 2.0
    torch.testing.assert_close(placed, expected)
    assert unplaced == 1  # row 1 has no turn 1

"""Where turns start and end, and the turn of every position (verl_ext.turns, docs/definitions.md §7),
against hand calculation, on numpy arrays and torch tensors alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_ext.turns import turn_ends, turn_index, turn_starts


def rows(text: str) -> list[list[int]]:
    """One string of digits per row: "10 01" gives [[1, 0], [0, 1]]."""
    return [[int(digit) for digit in row] for row in text.split()]


#: Row 0: two turns around an interior hole, then padding; row 1: a masked token before the first
#: turn, a one-token turn, a hole, a turn running to the end; row 2: no valid token at all.
MASK = rows("1100110 0101111 0000000")
STARTS = rows("1000100 0101000 0000000")
ENDS = rows("0100010 0100001 0000000")
#: Turns begun up to t, less one: −1 before the first turn, and a hole keeps the turn before it.
INDEX = [[0, 0, 0, 0, 1, 1, 1], [-1, 0, 0, 1, 1, 1, 1], [-1] * 7]


def as_numpy(values, dtype):
    return np.array(values, dtype=dtype)


def as_torch(values, dtype):
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize("make, dtypes", [(as_numpy, (bool, np.int64, np.float32)), (as_torch, (torch.bool, torch.int64, torch.float32))])
def test_starts_ends_and_index_by_hand(make, dtypes):
    for dtype in dtypes:
        mask = make(MASK, dtype)
        before = mask.tolist()
        starts = turn_starts(mask)
        assert starts.tolist() == np.array(STARTS, bool).tolist() and str(starts.dtype).endswith("bool")
        assert turn_ends(mask).tolist() == np.array(ENDS, bool).tolist()
        index = turn_index(starts)
        assert index.tolist() == INDEX and str(index.dtype).endswith("int64")
        assert mask.tolist() == before  # the caller's mask is left as it was


def test_one_row_short_rows_and_no_positions():
    """The last axis is the time axis whatever the rank; one position is a turn by itself."""
    assert turn_starts(np.array([0, 1, 1, 0, 1])).tolist() == [False, True, False, False, True]
    assert turn_ends(np.array([0, 1, 1, 0, 1])).tolist() == [False, False, True, False, True]
    assert turn_index(np.array([False, True, False, False, True])).tolist() == [-1, 0, 0, 0, 1]
    assert turn_starts(torch.tensor([[1], [0]])).tolist() == [[True], [False]]
    assert turn_ends(torch.tensor([[1], [0]])).tolist() == [[True], [False]]
    assert turn_starts(np.zeros((2, 0))).shape == (2, 0) and turn_index(torch.zeros(2, 0, dtype=torch.bool)).shape == (2, 0)


def test_every_turn_has_one_start_and_one_end_and_the_index_counts_them():
    """On random masks: starts and ends pair up row by row, a turn's tokens share its index, and
    widening a hole or the padding changes no token's turn."""
    rng = np.random.default_rng(11)
    mask = rng.random((50, 40)) < 0.6
    starts, ends, index = turn_starts(mask), turn_ends(mask), turn_index(turn_starts(mask))
    for row, s, e, k in zip(mask, starts, ends, index):
        first, last = np.flatnonzero(s), np.flatnonzero(e)
        assert len(first) == len(last) and (first <= last).all() and (last[:-1] < first[1:]).all()
        for turn, (a, b) in enumerate(zip(first, last)):
            assert row[a : b + 1].all() and (k[a : b + 1] == turn).all()
        widened = np.insert(row, np.flatnonzero(~row), False)  # every masked run twice as long
        valid_turns = turn_index(turn_starts(widened))[widened]
        assert valid_turns.tolist() == k[row].tolist()

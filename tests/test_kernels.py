"""The speed machinery under the estimators (verl_ext.kernels): the blocked discounted scan against
direct sums, compaction and the turn axis against hand calculation. The estimators built on them are
tested in tests/test_estimators.py, their float32 exactness under reduced matmul precision in
tests/test_precision.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verl_ext import kernels


@pytest.mark.parametrize("length", [1, 15, 16, 17, 255, 256, 257, 4097, 20000])
@pytest.mark.parametrize("discount", [0.0, 0.37, 0.999, 1.0])
def test_discounted_scan_across_block_levels(length, discount):
    """Lengths around SCAN_BLOCK powers exercise every recursion level of the blocked scan."""
    x = torch.randn(2, length, dtype=torch.float64)
    powers = discount ** np.arange(length, dtype=np.float64)
    xs = x.numpy()
    # y_t = Σ_k d^(k-t) x_k, written as a reversed convolution with the powers (float64)
    expected = np.stack([np.convolve(row[::-1], powers)[:length][::-1] for row in xs])
    actual = kernels.discounted_sum(x, discount).numpy()
    np.testing.assert_allclose(actual, expected, rtol=1e-9, atol=1e-9 * np.abs(expected).max())


def test_compaction_moves_the_valid_tokens_to_columns_one_on_and_back():
    """Row 0 has a hole at 1 and padding at 4; row 1 no valid token. Masked values (nan here) never
    reach the buffer: column 0, where they are parked, is cleared."""
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0]])
    x = torch.tensor([[10.0, float("nan"), 12.0, 13.0, float("nan")], [float("nan")] * 5])
    compaction = kernels.Compaction(mask)
    assert compaction.column.tolist() == [[1, 0, 2, 3, 0], [0, 0, 0, 0, 0]]
    assert compaction.width == kernels.SCAN_BLOCK  # T + 1 = 6 columns, rounded up to a whole block
    buffer = compaction.gather(x)
    expected = torch.zeros(2, kernels.SCAN_BLOCK)
    expected[0, 1:4] = torch.tensor([10.0, 12.0, 13.0])
    torch.testing.assert_close(buffer, expected)
    back = compaction.scatter(buffer)
    torch.testing.assert_close(back[mask != 0], torch.tensor([10.0, 12.0, 13.0]))


def test_the_turn_axis_of_compacted_rows_by_hand():
    """Compacted row 0: column 0 parked, valid tokens 1 … 5 in two turns (1-2 and 3-5), then the
    zeros after L; row 1: no turn. Turn k sits in column k + 1, column 0 collects nothing of a turn."""
    starts = torch.tensor([[0, 1, 0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.0, 0.0], [0.0] * 8])
    turns = kernels.Turns(starts)
    assert turns.column.tolist() == [[0, 1, 1, 2, 2, 2, 2, 2], [0] * 8]
    assert turns.width == 3  # the batch's most turns (2) + 1
    assert turns.sum(x).tolist() == [[0.0, 1.0 + 2.0, 3.0 + 4.0 + 5.0], [0.0, 0.0, 0.0]]
    assert turns.at_first_token(x).tolist() == [[0.0, 1.0, 3.0], [0.0, 0.0, 0.0]]
    assert turns.sum(x).dtype == turns.at_first_token(x).dtype == torch.float64
    spread = turns.spread(torch.tensor([[0.0, 10.0, 20.0], [0.0, 0.0, 0.0]]))
    assert spread.tolist() == [[0.0, 10.0, 10.0, 20.0, 20.0, 20.0, 20.0, 20.0], [0.0] * 8]

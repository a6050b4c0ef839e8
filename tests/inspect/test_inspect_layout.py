import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_ext.steps.layout import StepLayout


def long_format(rows_mask: list[list[bool]]):
    """(sample, token_index, mask) arrays of a step whose sample i has mask row ``rows_mask[i]``."""
    sample = np.concatenate([np.full(len(m), i, np.int32) for i, m in enumerate(rows_mask)])
    token_index = np.concatenate([np.arange(len(m), dtype=np.int32) for m in rows_mask])
    mask = np.concatenate([np.array(m, bool) for m in rows_mask])
    return sample, token_index, mask


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.lists(st.booleans(), min_size=1, max_size=40).map(lambda m: m[:-1] + [True]), min_size=1, max_size=12
    ),
    cells=st.integers(1, 200),
)
def test_row_groups_hold_every_valid_token_once_at_its_position(rows, cells):
    layout = StepLayout(*long_format(rows))
    seen = []
    values = np.arange(len(layout.valid_rows), dtype=np.float64) + 1  # one distinct number per valid token
    for group in layout.row_groups(cells):
        assert len(group.samples) == 1 or len(group.samples) * group.width <= cells
        dense = group.dense(values)
        for sample_row, sample in enumerate(group.samples):
            mask = np.array(rows[sample])
            expected = np.zeros(group.width)
            expected[: len(mask)][mask] = values[layout.valid_starts[sample] : layout.valid_starts[sample] + mask.sum()]
            assert np.array_equal(dense[sample_row], expected)
        assert np.array_equal(group.gather(dense), values[group.tokens])
        seen.extend(group.tokens.tolist())
    assert sorted(seen) == list(range(len(layout.valid_rows)))
    assert list(layout.problems()) == []
    assert layout.valid_counts.tolist() == [sum(m) for m in rows]


def test_problems_name_the_first_offending_row_of_each_kind():
    sample, token_index, mask = long_format([[True, True, True], [True, False, True], [True, True]])
    token_index[4] = 7  # sample 1: 0, 7, 2
    mask[7] = False  # sample 2 ends on a masked row
    problems = list(StepLayout(sample, token_index, mask).problems())
    assert [(p.row, p.count) for p in problems] == [(4, 1), (7, 1)]

    unsorted = StepLayout(np.array([0, 0, 2, 1]), np.array([0, 1, 0, 0]), np.ones(4, bool))
    assert [p.row for p in unsorted.problems()] == [3]
    assert "not sorted" in next(unsorted.problems()).message


def test_empty_step():
    layout = StepLayout(np.array([], np.int32), np.array([], np.int32), np.array([], bool))
    assert layout.samples == 0
    assert list(layout.problems()) == []
    assert list(layout.row_groups()) == []


def test_valid_position_counts_the_valid_rows_before_each_and_marks_a_masked_row():
    layout = StepLayout(*long_format([[True, False, True], [False, True], [True]]))
    assert layout.valid_position.tolist() == [0, -1, 1, -1, 2, 3]  # by hand

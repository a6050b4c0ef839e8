"""The truncation study's table (verl_ext.apps.truncation_study) from given numbers: no run (the
study's three runs take minutes; docs/definitions.md#cut-responses-the-three-treatments-measured
holds what one printed)."""

from __future__ import annotations

import math

import numpy as np

from verl_ext.apps.truncation_study import OptionResult, cut_step_line, mean, side_by_side


def result(option: str, value_after_last: float | None) -> OptionResult:
    return OptionResult(
        option=option, truncated_share=0.4375, truncated_share_last=0.5, cut_where_it_fits=0.25, adv_truncated=-0.12345,
        adv_rest=0.05, accuracy_before=0.6, accuracy_after=0.8125, explained_var=0.5, ev_mc=-0.25, score_truncated=0.9,
        value_after_last=value_after_last, seconds=61.6,
    )  # fmt: skip


def test_side_by_side_is_one_row_per_option_in_order():
    table = side_by_side([result("terminal", None), result("bootstrap", 0.8766)], steps=20).splitlines()

    assert table[0].startswith("| `algorithm.truncation` | cut share (last step) | mean A, cut | mean A, rest |")
    assert "before → after 20 steps" in table[0]
    assert table[0].count("|") == table[1].count("|") == table[2].count("|") == 12  # 11 columns
    assert table[2] == "| terminal | 0.438 (0.500) | -0.123 | +0.050 | 0.600 → 0.812 | 0.500 | -0.250 | 0.900 | — | 0.250 | 62 |"
    assert table[3] == "| bootstrap | 0.438 (0.500) | -0.123 | +0.050 | 0.600 → 0.812 | 0.500 | -0.250 | 0.900 | 0.877 | 0.250 | 62 |"
    assert len(table) == 4


def test_mean_over_steps_skips_blank_steps():
    # a step without a cut response has a blank adv_truncated: it is not a zero
    assert mean([0.5, None, -0.1]) == (0.5 - 0.1) / 2
    assert math.isnan(mean([None, None]))


def test_cut_step_line_groups_the_critic_values_by_score():
    scores, values = np.array([1.0, 0.2, 1.0, 0.2]), np.array([0.9, 0.3, 1.0, 0.1])
    # means by hand: all 0.6 and 0.575; score 1: (0.9 + 1.0)/2, score 0.2: (0.3 + 0.1)/2
    # correlation: deviations (0.4, -0.4, 0.4, -0.4) and (0.325, -0.275, 0.425, -0.475):
    # Σxy = 0.6, Σx² = 0.64, Σy² = 0.5875, r = 0.6 / sqrt(0.376) = 0.97849
    assert cut_step_line(scores, values) == (
        "4 cut responses, mean score 0.600, mean V(s_L) 0.575, correlation 0.978; "
        "mean V(s_L) by score (responses): score 1: 0.950 (2), score 0.2: 0.200 (2)"
    )

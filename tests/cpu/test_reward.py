"""The rule-based arithmetic reward (verl's custom reward function signature)."""

from __future__ import annotations

import pytest

from verl_ext.cpu.reward import arithmetic_score, compute_score


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        ("8", "8", 1.0),
        ("8</s>", "8", 1.0),
        (" 12=3", "12", 1.0),
        ("13", "12", 0.1 + 0.4 * 1 / 2),  # one leading digit right
        ("21", "12", 0.1),  # a number, no digit in place
        ("123", "12", 0.1 + 0.4 * 2 / 2),  # the right digits, then one too many: not correct
        ("+8", "8", 0.0),
        ("是的", "2", 0.0),
        ("", "8", 0.0),
    ],
)
def test_arithmetic_score(response, answer, score):
    assert arithmetic_score(response, answer) == pytest.approx(score)


def test_compute_score_reports_accuracy():
    assert compute_score("verl_ext/arithmetic", "8", "8") == {"score": 1.0, "acc": 1.0}
    assert compute_score("verl_ext/arithmetic", "9", "8", extra_info={}) == {"score": pytest.approx(0.1), "acc": 0.0}

"""The CPU task ("请问a+b=c？"): its problem sets, its texts and the reward verl calls."""

from __future__ import annotations

import pytest

from verl_ext.tasks.arith.reward import compute_score
from verl_ext.tasks.arith.task import Problem, balanced_sample, problem_sets, score_response, verdict_index


def test_the_seed_dialogue_is_a_problem_of_the_task():
    assert Problem(1, 1, 2).question() == "请问1+1=2？"
    assert Problem(1, 1, 2).answer() == "等于2，是的！"
    assert Problem(4, 8, 13).answer() == "等于12，不是！"


@pytest.fixture(scope="module")
def sets():
    return problem_sets(seed=0, max_delta=3, n_val=60)


def test_held_out_problems_are_never_trained_on_and_half_are_right(sets):
    train = set(sets.train_right) | set(sets.train_wrong)
    assert not train & set(sets.val)
    assert len(sets.val) == 60 and sum(p.right for p in sets.val) == 30
    assert all(p.right for p in sets.train_right) and not any(p.right for p in sets.train_wrong)
    # every problem of the task is in exactly one set: 100 right ones, and the wrong c within ±3 in [0, 18]
    wrong = sum(1 for a in range(10) for b in range(10) for d in (-3, -2, -1, 1, 2, 3) if 0 <= a + b + d <= 18)
    assert len(train) + len(sets.val) == 100 + wrong


def test_held_out_problems_keep_their_commuted_twin_in_training(sets):
    train = set(sets.train_right) | set(sets.train_wrong)
    for problem in sets.val:
        assert Problem(problem.b, problem.a, problem.c) in train


def test_a_balanced_sample_alternates_right_and_wrong(sets):
    sample = balanced_sample(sets, 10, seed=0)
    assert [p.right for p in sample] == [True, False] * 5
    assert balanced_sample(sets, 10, seed=0) == sample


@pytest.mark.parametrize(
    ("response", "expected", "score", "acc"),
    [
        ("等于5，是的！", "等于5，是的！", 1.0, 1.0),
        ("等于5，不是！", "等于5，是的！", 0.2, 0.0),  # right sum, wrong verdict
        ("等于6，是的！", "等于5，是的！", 0.2, 0.0),  # wrong sum, right verdict
        ("等于6，不是！", "等于5，是的！", 0.0, 0.0),
        ("等于5，是的！！", "等于5，是的！", 0.4, 0.0),  # both parts right, not the exact answer
        ("等于12，不是！", "等于12，不是！", 1.0, 1.0),
        ("等于1，不是！", "等于12，不是！", 0.2, 0.0),  # "1" is not the sum 12
        ("是的", "等于2，是的！", 0.0, 0.0),
        ("", "等于2，是的！", 0.0, 0.0),
    ],
)
def test_score_by_hand(response, expected, score, acc):
    scored = score_response(response, expected)
    assert (scored.score, scored.acc) == (pytest.approx(score), acc)


def test_compute_score_is_verls_custom_reward_signature():
    assert compute_score("verl_ext/sum_check", "等于5，是的！", "等于5，是的！", extra_info={}) == {"score": 1.0, "acc": 1.0}
    assert compute_score("verl_ext/sum_check", "等于5，不是！", "等于5，是的！") == {"score": pytest.approx(0.2), "acc": 0.0}


def test_the_verdict_token_follows_the_first_comma():
    mark = 33
    assert verdict_index([34, 35, 12, mark, 31, 32, 36, 3], mark, 3) == 4
    assert verdict_index([34, 35, 8, 9, mark, 38, 31], mark, 3) == 5
    assert verdict_index([34, 35, 12, 36], mark, 3) is None
    assert verdict_index([34, 35, mark], mark, 3) is None  # truncated right after the comma


def test_a_response_that_ends_after_the_comma_has_no_verdict():
    mark, eos = 33, 3
    assert verdict_index([34, 35, 12, mark, eos], mark, eos) is None  # "等于5，</s>": no verdict token

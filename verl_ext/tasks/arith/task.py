"""The CPU task: "请问a+b=c？" — is c the sum? Shaped like the user's own example ("请问1+1=2？").

A prompt asks whether ``c`` is the sum of two digits ``a`` and ``b``; half the prompts are right,
half wrong (``c = a+b+d`` with ``1 <= |d| <= max_delta``). The answer writes the sum first and
then the verdict::

    请问2+3=5？  ->  等于5，是的！
    请问2+3=6？  ->  等于5，不是！

Sum first, because a two-layer model cannot compare ``c`` with ``a+b`` before it has written the
sum (verdict first, RL plateaus at the accuracy of guessing from ``c`` alone): the verdict is the
one token the policy must learn, decided in the middle of the response, while the outcome reward
sits on the last token — the delayed-credit question of the user's notes ("why do the early tokens
learn?").

Pure Python: problem sets, texts and the score. The reward verl calls is :mod:`verl_ext.tasks.arith.reward`.
"""

from __future__ import annotations

import random
from typing import NamedTuple

YES, NO = "是的", "不是"
#: The character before the verdict; the verdict token is the one after the first of these.
VERDICT_MARK = "，"
#: Score of a response that is not fully right: a share for each part it gets right.
SUM_CREDIT = 0.2
VERDICT_CREDIT = 0.2


class Problem(NamedTuple):
    a: int
    b: int
    c: int

    @property
    def right(self) -> bool:
        return self.a + self.b == self.c

    def question(self) -> str:
        return f"请问{self.a}+{self.b}={self.c}？"

    def answer(self) -> str:
        return f"等于{self.a + self.b}{VERDICT_MARK}{YES if self.right else NO}！"


class ProblemSets(NamedTuple):
    train_right: list[Problem]
    train_wrong: list[Problem]
    #: Held out from the warm start and from RL: half right, half wrong.
    val: list[Problem]


def problem_sets(seed: int, max_delta: int, n_val: int) -> ProblemSets:
    """Every problem with digits ``a, b``, split into train and ``n_val`` held-out ones.

    Held-out problems have ``a < b``, so their commuted twin ``b+a=c`` (a different prompt) stays
    in training: the held-out prompts are unseen, and test whether the verdict carries over to
    them, not whether the model can add two digits it never saw together.
    """
    sums = [(a, b) for a in range(10) for b in range(10)]
    right = [Problem(a, b, a + b) for a, b in sums]
    wrong = [
        Problem(a, b, a + b + d) for a, b in sums for d in range(-max_delta, max_delta + 1) if d and 0 <= a + b + d <= 18
    ]
    rng = random.Random(seed)
    rng.shuffle(right)
    rng.shuffle(wrong)
    val_right = [p for p in right if p.a < p.b][: n_val // 2]
    val_wrong = [p for p in wrong if p.a < p.b][: n_val - n_val // 2]
    held_out = set(val_right + val_wrong)
    return ProblemSets(
        [p for p in right if p not in held_out], [p for p in wrong if p not in held_out], val_right + val_wrong
    )


def balanced_sample(sets: ProblemSets, n: int, seed: int) -> list[Problem]:
    """``n`` training problems, right and wrong alternating, each drawn uniformly from its set."""
    rng = random.Random(seed)
    return [rng.choice(sets.train_right if i % 2 == 0 else sets.train_wrong) for i in range(n)]


class Score(NamedTuple):
    score: float
    acc: float
    sum_right: bool
    verdict_right: bool


def score_response(response: str, expected: str) -> Score:
    """Score ``response`` against the expected answer (``Problem.answer()``).

    1.0 when the response is exactly the expected answer (verl decodes it without the EOS token);
    otherwise ``SUM_CREDIT`` when it starts with the right "等于<sum>，" plus ``VERDICT_CREDIT``
    when the two characters after its first "，" are the right verdict (at most 0.4).
    ``acc`` is 1.0 for a fully right response, else 0.0.
    """
    head, _, verdict = expected.partition(VERDICT_MARK)
    sum_right = response.startswith(head + VERDICT_MARK)
    verdict_right = VERDICT_MARK in response and response.partition(VERDICT_MARK)[2][:2] == verdict[:2]
    if response == expected:
        return Score(1.0, 1.0, True, True)
    return Score(SUM_CREDIT * sum_right + VERDICT_CREDIT * verdict_right, 0.0, sum_right, verdict_right)


def verdict_index(response_ids: list[int], mark_id: int, eos_id: int) -> int | None:
    """Position of the verdict token in a response: the token after the first ``VERDICT_MARK``;
    None when there is none, or when that token ends the response (``eos_id``)."""
    try:
        position = response_ids.index(mark_id) + 1
    except ValueError:
        return None
    return position if position < len(response_ids) and response_ids[position] != eos_id else None

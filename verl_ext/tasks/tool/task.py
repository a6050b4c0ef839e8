"""The tool task: "请问37+48=85？" — is c the sum? — with a calculator the policy may call first.

The question and the answer are the arithmetic task's (:class:`verl_ext.tasks.arith.task.Problem`),
with numbers of ``digits`` digits: a sum the two-layer model gets wrong in its head, and the
calculator (:mod:`.calculator`) gets right. A response either answers at once, or first calls the
tool in verl's hermes format and answers after the tool's message::

    <tool_call>{"name":"add","arguments":{"a":37,"b":48}}</tool_call></s>      (written: mask 1)
    <|tool|><tool_response>85</tool_response><|assistant|>                     (the agent loop's: mask 0)
    等于85，是的！</s>                                                          (written: mask 1)

The reward scores the text after the last tool response as arith's reward scores a response.
Pure Python; the reward verl calls is :mod:`verl_ext.tasks.tool.reward`.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from verl_ext.tasks.arith.task import Problem, Score, score_response

TOOL_NAME = "add"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
RESPONSE_START, RESPONSE_END = "<tool_response>", "</tool_response>"
#: The fixed parts of a call, each one token of the task's tokenizer: a call is 8 tokens and the
#: digits of ``a`` and ``b``.
CALL_PREFIX, CALL_SEPARATOR, CALL_SUFFIX = '{"name":"' + TOOL_NAME + '","arguments":{"a":', ',"b":', "}}"


class ProblemSets(NamedTuple):
    train: list[Problem]
    #: Held out from the warm start and from RL: half right, half wrong, pairs (a, b) unseen.
    val: list[Problem]


def problem(rng: random.Random, digits: int, right: bool, max_delta: int) -> Problem:
    """A random problem with ``digits``-digit ``a`` and ``b``; ``c = a+b`` when ``right``, else
    ``a+b+d`` with ``1 <= |d| <= max_delta``."""
    low, high = 10 ** (digits - 1), 10**digits - 1
    a, b = rng.randint(low, high), rng.randint(low, high)
    d = 0 if right else rng.choice([d for d in range(-max_delta, max_delta + 1) if d])
    return Problem(a, b, a + b + d)


def problem_sets(seed: int, digits: int, max_delta: int, n_train: int, n_val: int) -> ProblemSets:
    """``n_train`` training problems (right and wrong alternating) and ``n_val`` held-out ones whose
    pairs (a, b) appear in no training problem."""
    rng = random.Random(seed)
    val = [problem(rng, digits, i % 2 == 0, max_delta) for i in range(n_val)]
    held_out = {(p.a, p.b) for p in val}
    train: list[Problem] = []
    while len(train) < n_train:
        candidate = problem(rng, digits, len(train) % 2 == 0, max_delta)
        if (candidate.a, candidate.b) not in held_out:
            train.append(candidate)
    return ProblemSets(train, val)


def call_text(p: Problem) -> str:
    """The exact tool call for ``p``, as verl's hermes parser reads it."""
    return f"{CALL_START}{CALL_PREFIX}{p.a}{CALL_SEPARATOR}{p.b}{CALL_SUFFIX}{CALL_END}"


def final_answer(solution: str) -> str:
    """The text after the last tool response, or all of ``solution`` when the tool never answered."""
    return solution.rpartition(RESPONSE_END)[2]


def score_solution(solution: str, expected: str) -> Score:
    """Score a whole response as verl's reward sees it (special tokens removed): its final answer,
    scored as the arithmetic task scores one."""
    return score_response(final_answer(solution), expected)

"""Rule-based reward for the generated arithmetic prompts ("a+b=").

verl calls this as its custom reward function (``reward.custom_reward_function.path`` pointing at
this file, ``name=compute_score``). verl itself puts the returned score on the last valid response
token (``AgentLoopWorker._postprocess``: ``rm_scores[i, valid_length - 1] = score``), so
``token_level_scores`` is zero everywhere except that token.

Score (documented, so a random model still produces non-trivial ``token_level_scores``):

* 1.0 when the response starts with the correct integer (leading spaces allowed; the number ends at
  the first non-digit, e.g. ``"8</s>"`` or ``"8=..."``);
* otherwise, when the response starts with an integer at all:
  ``0.1 + 0.4 * (leading digits that match the answer's digits position by position) / len(answer)``,
  i.e. a value in [0.1, 0.5] (0.5: every digit right, but too many of them, e.g. "81" for 8);
* 0.0 when the response does not start with a digit.
"""

from __future__ import annotations

import re

_LEADING_INTEGER = re.compile(r"\s*(\d+)")

CORRECT = 1.0
FORMAT_CREDIT = 0.1
DIGIT_CREDIT = 0.4


def arithmetic_score(response: str, answer: str) -> float:
    """The score of one response against the expected answer (a non-negative integer as text)."""
    match = _LEADING_INTEGER.match(response)
    if match is None:
        return 0.0
    produced = match.group(1)
    if produced == answer:
        return CORRECT
    matched = 0
    for got, want in zip(produced, answer):
        if got != want:
            break
        matched += 1
    return FORMAT_CREDIT + DIGIT_CREDIT * matched / len(answer)


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl's custom-reward-function signature (``NaiveRewardManager.run_single``).

    Returns a dict so verl logs ``acc`` (exact correctness) next to ``score`` in its metrics.
    """
    score = arithmetic_score(solution_str, str(ground_truth))
    return {"score": score, "acc": float(score == CORRECT)}

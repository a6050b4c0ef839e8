"""The reward verl calls for the tool task (:mod:`verl_ext.tasks.tool.task`).

verl decodes the whole multi-turn response without special tokens (the call, the tool's answer in
its ``<tool_response>`` markers, the final answer) and puts the score on the last response token,
which is always a token the policy wrote. The score is the arithmetic task's, of the text after
the last tool response: 1.0 for exactly the expected answer, else 0.2 for the right sum plus 0.2
for the right verdict.
"""

from __future__ import annotations

from verl_ext.tasks.tool.task import score_solution


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl's custom-reward-function signature; ``acc`` is 1.0 for a fully right answer."""
    scored = score_solution(solution_str, str(ground_truth))
    return {"score": scored.score, "acc": scored.acc}

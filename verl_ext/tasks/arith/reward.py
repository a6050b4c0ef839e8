"""The reward verl calls for the CPU task (:mod:`verl_ext.tasks.arith.task`): "请问a+b=c？" -> "等于<a+b>，是的！|不是！".

verl loads this file by path as its custom reward function (``reward.custom_reward_function.path``,
``name=compute_score``) and puts the returned score on the last valid response token
(``AgentLoopWorker._postprocess``: ``rm_scores[i, valid_length - 1] = score``), so
``token_level_scores`` is zero everywhere except that token.

Score (:func:`verl_ext.tasks.arith.task.score_response`): 1.0 for exactly the expected answer; otherwise
0.2 for the right "等于<sum>，" plus 0.2 for the right verdict (at most 0.4).
"""

from __future__ import annotations

from verl_ext.tasks.arith.task import score_response


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """verl's custom-reward-function signature (``NaiveRewardManager.run_single``).

    Returns a dict, so verl logs ``acc`` (fully right) next to ``score``; in validation
    ``val-core/<data_source>/acc/mean@<n>``. Nothing more: verl carries every entry per response
    through the whole step and bootstraps each in validation, which costs seconds on a CPU.
    """
    scored = score_response(solution_str, str(ground_truth))
    return {"score": scored.score, "acc": scored.acc}

"""Where the credit lands on the CPU task: the advantage at the verdict token against the rest.

The verdict ("是" or "不", the token after the first "，") is the one decision of a response the
policy has to learn; the outcome reward sits on the last token. A response whose token after "，"
is the end of the sequence has no verdict. Per traced step:

* :func:`verdict_credit`: the advantage the update used (``advantage``, after whitening): mean |A|
  at the verdict tokens, at the other valid tokens, and the verdict tokens' share of Σ|A|;
* :func:`verdict_share_by_estimator`: that share for other estimators, re-estimated from the
  step's recorded rewards and values (raw advantages, what ``verl-ext compare`` computes);
* :func:`critic_at_verdict`: the critic's explained variance against the Monte-Carlo return
  (:mod:`verl_ext.inspect.critic`) at the states before and after the verdict: after it the outcome
  is decided, and a critic that has learned the task sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from verl_ext.inspect.comparison import DEFAULT_LAMBDAS, DEFAULT_N, step_estimates
from verl_ext.inspect.critic import explained_variance, monte_carlo_returns
from verl_ext.inspect.stepdata import RecordedAlgorithm, StepData
from verl_ext.tasks.arith.assets import EOS, special_token_id, token_id
from verl_ext.tasks.arith.task import VERDICT_MARK, verdict_index

#: The estimators the demo sets side by side: λ = 0 (td0), the GAE in between, λ = 1 (mc).
SIDE_BY_SIDE = ("mc", "gae0.95", "td0")


@dataclass(frozen=True)
class VerdictCredit:
    step: int
    score: float  # mean score of the step's responses
    verdict_abs: float  # mean |A| at the verdict tokens
    rest_abs: float  # mean |A| at the other valid tokens
    verdict_share: float  # the verdict tokens' share of the step's Σ|A|
    responses: int  # responses with a verdict token

    def line(self) -> str:
        return (
            f"step {self.step:3d}  score {self.score:.3f}   mean |A|: verdict {self.verdict_abs:.3f}, "
            f"rest {self.rest_abs:.3f}   verdict share of Σ|A| {self.verdict_share:.2f}"
        )


def verdict_positions(trace, step: int) -> dict[int, int]:
    """sample -> token_index of its verdict token, for the step's responses that have one."""
    return _verdict_positions(trace.read_step(step, ["sample", "token_index", "token_id", "mask"]).to_pandas())


def verdict_credit(trace, step: int) -> VerdictCredit:
    """The step's credit at the verdict token (see the module docstring)."""
    table = trace.read_step(step, ["sample", "token_index", "token_id", "mask", "score", "advantage"]).to_pandas()
    verdicts = _verdict_positions(table)
    table = table[table["mask"]]
    at_verdict = np.array([verdicts.get(s) == t for s, t in zip(table["sample"], table["token_index"])], dtype=bool)
    magnitude = table["advantage"].abs().to_numpy(np.float64)
    total = magnitude.sum()
    return VerdictCredit(
        step=step,
        score=float(table.groupby("sample")["score"].sum().mean()),
        verdict_abs=float(magnitude[at_verdict].mean()) if at_verdict.any() else float("nan"),
        rest_abs=float(magnitude[~at_verdict].mean()) if (~at_verdict).any() else float("nan"),
        verdict_share=float(magnitude[at_verdict].sum() / total) if total > 0 else float("nan"),
        responses=len(verdicts),
    )


def verdict_share_by_estimator(
    trace, step: int, labels: tuple[str, ...] | None = SIDE_BY_SIDE, lambdas: tuple[float, ...] = DEFAULT_LAMBDAS
) -> dict[str, float]:
    """label -> the verdict tokens' share of the step's Σ|raw advantage| under that estimator,
    re-estimated from the recorded rewards and values, for ``labels`` among the columns of
    :func:`verl_ext.inspect.comparison.step_estimates` at ``lambdas`` (``mc``, ``td0``,
    ``gae0.95``, a user's estimator by its name, …; None: all of them)."""
    data = StepData.read(trace, step, ("reward", "value"))
    estimates, _ = step_estimates(data, RecordedAlgorithm.from_record(trace.record), DEFAULT_N, lambdas, labels)
    at_verdict = _verdict_index_per_token(trace, step, data) == _token_index(data)
    shares = {}
    for label, raw in estimates.items():
        magnitude = np.abs(raw)
        shares[label] = float(magnitude[at_verdict].sum() / magnitude.sum()) if magnitude.sum() > 0 else float("nan")
    return shares


def critic_at_verdict(trace, step: int) -> tuple[float | None, float | None]:
    """(EV after, EV before): the critic's explained variance against the Monte-Carlo return at the
    states that have seen the verdict token (token_index > verdict) and at those up to it; (None,
    None) for a run without a critic."""
    data = StepData.read(trace, step, ("reward", "value"))
    values = data.columns["value"]
    if values is None:
        return None, None
    returns = monte_carlo_returns(data, RecordedAlgorithm.from_record(trace.record).gamma)
    verdict_of_token = _verdict_index_per_token(trace, step, data)
    has_verdict = verdict_of_token >= 0
    after = has_verdict & (_token_index(data) > verdict_of_token)
    before = has_verdict & ~after
    return explained_variance(values[after], returns[after]), explained_variance(values[before], returns[before])


def _token_index(data: StepData) -> np.ndarray:
    return data.layout.token_index[data.layout.valid_rows]


def _verdict_index_per_token(trace, step: int, data: StepData) -> np.ndarray:
    """(N,) the verdict token_index of each valid token's response, −1 without a verdict."""
    layout = data.layout
    samples = layout.sample_ids[layout.valid_sample_index()]
    verdicts = verdict_positions(trace, step)
    return np.array([verdicts.get(int(sample), -1) for sample in samples], dtype=np.int64)


def _verdict_positions(table) -> dict[int, int]:
    """sample -> token_index of the verdict, by :func:`verl_ext.tasks.arith.task.verdict_index` on each
    response's valid tokens (rows sorted by sample and token_index, as the reader returns them)."""
    mark, eos = token_id(VERDICT_MARK), special_token_id(EOS)
    positions = {}
    for sample, rows in table[table["mask"]].groupby("sample", sort=False):
        index = verdict_index(rows["token_id"].tolist(), mark, eos)
        if index is not None:
            positions[int(sample)] = int(rows["token_index"].iloc[index])
    return positions

"""Where the credit lands on the CPU task: the advantage at the verdict token against the rest.

The task defines the verdict (:func:`verl_ext.tasks.arith.task.verdict_index`: "是" or "不", the
token after the first "，"), the one decision of a response the policy has to learn; the outcome
reward sits on the last token. A response whose token after "，" ends the sequence has no verdict.
:func:`step_credit` reads a traced step once and gives:

* the advantage the update used (``advantage``, after whitening): mean |A| at the verdict tokens, at
  the other valid tokens, and the verdict tokens' share of Σ|A|;
* the critic's explained variance against the Monte-Carlo return (:mod:`verl_ext.inspect.critic`)
  at the states after the verdict and at those up to it: after it the outcome is decided, and a
  critic that has learned the task sees it;
* on request, the verdict's share of Σ|raw A| under other estimators, re-estimated from the step's
  recorded rewards and values (what ``verl-ext compare`` computes): mc, GAE(0.95) and td0 by default;
* on the tool task (:mod:`verl_ext.tasks.tool`), the other decision: the response's first token,
  ``<tool_call>`` or not. The share of responses that call, and the first tokens' share of Σ|A|;
  and, by turn (:func:`turn_advantages`), the share of Σ|raw A| on the call decision, on the verdict
  and on each turn under turn_gae, mc, gae_ext and grpo, re-estimated from the step's records.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import numpy as np

from verl_ext.step_metrics import explained_variance
from verl_ext.steps.as_run import DEFAULT_N, as_run, monte_carlo_returns, step_estimates
from verl_ext.steps.cuts import StepCuts
from verl_ext.steps.layout import LAYOUT_COLUMNS, StepData
from verl_ext.steps.recorded import RecordedAlgorithm
from verl_ext.tasks import DEFAULT_TASK, get_task

#: λ of the GAE the demo sets between td0 (λ = 0) and mc (λ = 1).
SIDE_BY_SIDE_LAMBDA = 0.95


def side_by_side() -> tuple[str, ...]:
    """The compare labels of mc, GAE(SIDE_BY_SIDE_LAMBDA) and td0 (λ = 1, in between, 0)."""
    from verl_ext import registry
    from verl_ext.steps.as_run import column_label

    return ("mc", column_label(registry.get("gae"), {"lam": SIDE_BY_SIDE_LAMBDA}), "td0")


@dataclass(frozen=True)
class StepCredit:
    step: int
    score: float  # mean score of the step's responses
    verdict_abs: float  # mean |A| at the verdict tokens
    rest_abs: float  # mean |A| at the other valid tokens
    verdict_share: float  # the verdict tokens' share of the step's Σ|A|
    verdicts: dict[int, int]  # sample -> token_index of its verdict, for the responses that have one
    ev_after_verdict: float | None  # None without a critic
    ev_before_verdict: float | None
    shares_by_estimator: dict[str, float] = field(default_factory=dict)  # label -> verdict share of Σ|raw A|
    call_rate: float | None = None  # the share of responses that start with a tool call (tool task)
    decision_share: float | None = None  # the first tokens' share of Σ|A| (tool task)

    def line(self) -> str:
        critic = f"   critic EV after the verdict {self.ev_after_verdict:+.2f}" if self.ev_after_verdict is not None else ""
        tool = "" if self.call_rate is None else f"tool calls {self.call_rate:4.0%}   "
        decision = "" if self.decision_share is None else f", call decision {self.decision_share:.2f}"
        return (
            f"step {self.step:3d}  score {self.score:.3f}   {tool}mean |A|: verdict {self.verdict_abs:.3f}, "
            f"rest {self.rest_abs:.3f}   share of Σ|A|: verdict {self.verdict_share:.2f}{decision}{critic}"
        )


def step_credit(trace, step: int, labels: tuple[str, ...] = (), task: str = DEFAULT_TASK) -> StepCredit:
    """The step's credit at the verdict (module docstring), the step read once; ``labels``: the
    compare columns whose verdict share to re-estimate (e.g. :func:`side_by_side`); ``task``: the
    name of the task whose decision tokens these are (:class:`verl_ext.tasks.Task`: the verdict, and
    the tool call where it has one)."""
    table = trace.read_step(step, [*LAYOUT_COLUMNS, "token_id", "score", "advantage", "reward", "value"])
    data = StepData.from_table(step, table, ("score", "advantage", "reward", "value"))
    algorithm = RecordedAlgorithm.from_record(trace.record)
    layout = data.layout
    token_index = layout.token_index[layout.valid_rows]
    token_ids = table.column("token_id").to_numpy()[layout.valid_rows]
    tokens = _decision_token_ids(task)
    verdict_of_token, verdicts = _verdicts(token_ids, token_index, layout, tokens["mark"], tokens["eos"])
    at_verdict = token_index == verdict_of_token

    magnitude = np.abs(data.columns["advantage"])
    sampled = np.flatnonzero(layout.valid_counts)
    scores = layout.sample_sums(data.columns["score"])[sampled]
    ev_after = ev_before = None
    if data.columns["value"] is not None:
        values, returns = data.columns["value"], monte_carlo_returns(data, algorithm.gamma)
        after = (verdict_of_token >= 0) & (token_index > verdict_of_token)
        before = (verdict_of_token >= 0) & ~after
        ev_after, ev_before = explained_variance(values[after], returns[after]), explained_variance(values[before], returns[before])
    shares = {}
    if labels and data.columns["value"] is not None:  # without a critic there is nothing to re-estimate from
        cuts = StepCuts.read(trace, step, layout)
        estimates, _ = step_estimates(data, algorithm, DEFAULT_N, (SIDE_BY_SIDE_LAMBDA,), labels, cuts)
        shares = {label: _share(np.abs(raw), at_verdict) for label, raw in estimates.items()}
    call_rate = decision_share = None
    if "call" in tokens:
        first = token_index == 0
        call_rate = float(np.mean(token_ids[first] == tokens["call"])) if first.any() else float("nan")
        decision_share = _share(magnitude, first)
    return StepCredit(
        step=step,
        score=float(scores.mean()) if len(scores) else float("nan"),
        verdict_abs=float(magnitude[at_verdict].mean()) if at_verdict.any() else float("nan"),
        rest_abs=float(magnitude[~at_verdict].mean()) if (~at_verdict).any() else float("nan"),
        verdict_share=_share(magnitude, at_verdict),
        verdicts=verdicts,
        ev_after_verdict=ev_after,
        ev_before_verdict=ev_before,
        shares_by_estimator=shares,
        call_rate=call_rate,
        decision_share=decision_share,
    )


def _share(magnitude: np.ndarray, at_verdict: np.ndarray) -> float:
    total = magnitude.sum()
    return float(magnitude[at_verdict].sum() / total) if total > 0 else float("nan")


def _decision_token_ids(task_name: str) -> dict[str, int]:
    """The ids of the task's verdict mark and EOS in its tokenizer, and of its tool call's first token
    when it has one."""
    # `verl-ext study` reads its runs from threads, and transformers' lazy import is not thread-safe
    # ("cannot import name 'PreTrainedTokenizerFast'" when two threads build a tokenizer at once)
    with _TOKENIZER_LOCK:
        return _built_decision_token_ids(task_name)


_TOKENIZER_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)  # a task's tokenizer is built once, not at every step read
def _built_decision_token_ids(task_name: str) -> dict[str, int]:
    task = get_task(task_name)
    tokenizer = task.tokenizer()
    marks = {"mark": task.verdict_mark, "call": task.call_token}
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in marks.items() if token is not None}
    return {"eos": tokenizer.eos_token_id, **ids}


def _verdicts(token_ids: np.ndarray, token_index: np.ndarray, layout, mark: int, eos: int) -> tuple[np.ndarray, dict[int, int]]:
    """((N,) the verdict token_index of each valid token's response, −1 without a verdict; sample ->
    verdict token_index), by the task's ``verdict_index`` on each response's valid tokens."""
    from verl_ext.tasks.arith.task import verdict_index

    verdict_of_token = np.full(len(token_ids), -1, dtype=np.int64)
    verdicts = {}
    for sample, start, count in zip(layout.sample_ids, layout.valid_starts, layout.valid_counts):
        index = verdict_index(token_ids[start : start + count].tolist(), mark, eos)
        if index is not None:
            verdicts[int(sample)] = int(token_index[start + index])
            verdict_of_token[start : start + count] = verdicts[int(sample)]
    return verdict_of_token, verdicts


# --------------------------------------------------------------------------- by turn (the tool task)

#: The estimators the tool task's credit is set side by side under, on one recorded step: label ->
#: (registered name, its options). ``turn_gae`` takes the run's settings when the run is turn_gae's
#: (its label then says its λ); ``grpo`` is computed from the step's rewards and prompt groups
#: (:func:`grpo_advantages`).
TURN_CREDIT_ESTIMATORS = {
    "turn_gae": ("turn_gae", {}),
    "mc": ("mc", {}),
    "gae_ext": ("gae_ext", {"lam_critic": 1.0, "lam_actor": 0.95}),
    "grpo": ("grpo", None),
}


@dataclass(frozen=True)
class TurnAdvantages:
    """One step's valid tokens (N,) and their raw advantages under the estimators of
    :data:`TURN_CREDIT_ESTIMATORS`, re-estimated from the recorded rewards and values."""

    sample: np.ndarray
    token_index: np.ndarray
    turn: np.ndarray
    decision: np.ndarray  # bool: a response's first token (the call decision)
    verdict: np.ndarray  # bool: a verdict token
    by_estimator: dict[str, np.ndarray]

    def shares(self) -> dict[str, dict[str, float]]:
        """label -> the share of the step's Σ|raw A| on the call decision, on the verdict and on each turn."""
        turns = range(int(self.turn.max()) + 1 if len(self.turn) else 0)
        out = {}
        for label, raw in self.by_estimator.items():
            magnitude = np.abs(raw)
            out[label] = {
                "call decision": _share(magnitude, self.decision), "verdict": _share(magnitude, self.verdict),
                **{f"turn {k}": _share(magnitude, self.turn == k) for k in turns},
            }  # fmt: skip
        return out


def turn_advantages(trace, step: int, task: str) -> TurnAdvantages:
    """The step's raw advantages under each estimator of :data:`TURN_CREDIT_ESTIMATORS` (ValueError
    without recorded values: the critic's estimators need them)."""
    from verl_ext import registry

    table = trace.read_step(step, [*LAYOUT_COLUMNS, "token_id", "turn", "reward", "value"])
    data = StepData.from_table(step, table, ("reward", "value"))
    if data.columns["value"] is None:
        raise ValueError(f"step {step} has no values (a run without a critic): turn_gae, mc and gae_ext need them")
    layout = data.layout
    token_index = layout.token_index[layout.valid_rows]
    token_ids = table.column("token_id").to_numpy()[layout.valid_rows]
    tokens = _decision_token_ids(task)
    verdict_of_token, _ = _verdicts(token_ids, token_index, layout, tokens["mark"], tokens["eos"])
    algorithm = RecordedAlgorithm.from_record(trace.record)
    cuts = StepCuts.read(trace, step, layout)
    by_estimator = {}
    for label, (name, options) in TURN_CREDIT_ESTIMATORS.items():
        if options is None:
            by_estimator[label] = grpo_advantages(data, trace.prompts(step))
            continue
        estimator = registry.get(name)
        if name == "turn_gae" and algorithm.estimator is estimator:
            settings = algorithm.settings
        else:
            settings = estimator.settings({**options, "gamma": algorithm.gamma})
        if name == "turn_gae":
            label = f"turn_gae λ={settings['lam']:g}"
        by_estimator[label] = as_run(data, algorithm, cuts, estimator, settings).before_whitening
    return TurnAdvantages(
        sample=layout.sample_ids[layout.valid_sample_index()],
        token_index=token_index,
        turn=table.column("turn").to_numpy()[layout.valid_rows].astype(np.int64),
        decision=token_index == 0,
        verdict=token_index == verdict_of_token,
        by_estimator=by_estimator,
    )


def grpo_advantages(data: StepData, prompts) -> np.ndarray:
    """verl's GRPO advantage at each valid token: (G − the mean of its prompt group's G) / (the
    group's std + 1e-6), G a response's summed reward and the std with n − 1 (a group of one: G /
    (1 + 1e-6), as verl sets mean 0 and std 1); ``prompts``: the step's prompt table (its ``uid``
    groups the responses)."""
    layout = data.layout
    scores = layout.sample_sums(data.columns["reward"])
    uid_of = dict(zip(prompts.column("sample").to_pylist(), prompts.column("uid").to_pylist()))
    groups: dict = {}
    for position, sample in enumerate(layout.sample_ids):
        groups.setdefault(uid_of[int(sample)], []).append(position)
    advantage = np.zeros(len(layout.sample_ids))
    for members in groups.values():
        group_scores = scores[members]
        mean, std = (group_scores.mean(), group_scores.std(ddof=1)) if len(members) > 1 else (0.0, 1.0)
        advantage[members] = (group_scores - mean) / (std + 1e-6)
    return np.repeat(advantage, layout.valid_counts)

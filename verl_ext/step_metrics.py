"""Is the critic ready, where does the credit go: the per-step quantities of docs/definitions.md §9
(its critic diagnostic and live metrics), from one step's valid tokens (numpy in, numbers out; no verl, no torch).

A step is given compacted: each per-token array holds the step's valid tokens, response by response
and in token order within a response, and :class:`Responses` says how many valid tokens L each
response has. The live metrics (:mod:`verl_ext.integration.metrics_hook`) build this from verl's
padded batch on the driver, the inspection (:mod:`verl_ext.inspect.critic`,
:mod:`verl_ext.inspect.summary`) from a trace's step; both call the functions here, so a traced
step's live metrics are its post-hoc numbers.

Positions: the valid token of rank i (0-based) of a response with L valid tokens is in decile
``d{⌊10·i/L⌋}``; ``last`` is each response's last valid token; the first half is d0–d4 (2i < L).
Turns (docs/definitions.md §7; a multi-turn response's holes are not among its valid tokens, so
``Responses`` says where each assistant turn starts): ``turn{k}`` is the first token of each
response's turn k, the state after the k-th hole (a tool's answer); ``after_hole`` all of those with
k ≥ 1. A step whose responses all have one turn has no turn metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Sequence

import numpy as np

from verl_ext.turns import turn_index

DECILES = tuple(f"d{i}" for i in range(10))
#: Position buckets of the critic's diagnostics, in column order: the deciles, the last token, all.
BUCKETS = (*DECILES, "last", "all")
#: The statistics of one bucket (:func:`critic_by_group`).
CRITIC_STATISTICS = ("tokens", "explained_var", "mean_abs_error", "mean_return", "mean_value")
#: A position bucket's explained variance needs this many tokens (docs/definitions.md §9): below it,
#: Var(G) of a handful of returns can sit near 0 by chance and the ratio swings far below −1 (the
#: demo's d9, 2 to 7 tokens from its few responses of 10 tokens or more: −2 to −31) and means nothing.
MIN_EV_TOKENS = 8

#: The live metrics' names (under verl_ext/ in verl's metrics), each a quantity of :func:`step_metrics`.
EV_ALL, EV_LAST = "critic/ev_mc", "critic/ev_mc_last"
EV_BUCKET = "critic/ev_mc/{bucket}"  # d0 … d9, and on multi-turn steps turn0, turn1, …, after_hole
TURN_SHARE = "credit/share/{turn}"  # turn0, turn1, …: the share of the step's Σ|A| on each turn
RAW_STD, WHITEN_MEAN, WHITEN_STD = "adv/raw_std", "adv/whiten_mean", "adv/whiten_std"
GROUP_STD = "reward/group_std"
TOP_TOKEN_SHARE, FIRST_HALF_SHARE = "credit/top_token_share", "credit/first_half_share"
PREFIX = "verl_ext/"


@dataclass(frozen=True)
class Responses:
    """The valid tokens of a step's responses: ``lengths[b]`` = L of response b (0 for none)."""

    lengths: np.ndarray
    #: (N,) bool: True at the first valid token of each assistant turn; None: one turn each.
    turn_starts: np.ndarray | None = None

    @classmethod
    def of(cls, lengths: Sequence[int] | np.ndarray, turn_starts: np.ndarray | None = None) -> "Responses":
        return cls(np.asarray(lengths, dtype=np.int64), None if turn_starts is None else np.asarray(turn_starts, bool))

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @cached_property
    def starts(self) -> np.ndarray:
        """(B,) index of each response's first valid token among the step's valid tokens."""
        return np.cumsum(self.lengths) - self.lengths

    @cached_property
    def decile(self) -> np.ndarray:
        """(N,) ⌊10·i/L⌋ of each valid token."""
        starts, deciles = self.decile_segments
        return np.repeat(deciles, np.diff(np.append(starts, self.tokens)))

    @cached_property
    def decile_segments(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, decile): the runs of tokens of one response in one decile, in token order (empty
        runs left out): decile k of a response of length L holds ranks ⌈kL/10⌉ … ⌈(k+1)L/10⌉ − 1.
        Computed from the lengths alone, so that the tokens are read only to be summed."""
        k = np.arange(10)
        first = self.starts[:, None] + (k * self.lengths[:, None] + 9) // 10  # ⌈kL/10⌉
        ends = np.concatenate((first[:, 1:], (self.starts + self.lengths)[:, None]), axis=1)
        nonempty = (ends > first).reshape(-1)
        return first.reshape(-1)[nonempty], np.broadcast_to(k, first.shape).reshape(-1)[nonempty]

    @cached_property
    def turn(self) -> np.ndarray:
        """(N,) the assistant turn k of each valid token (0 everywhere without ``turn_starts``)."""
        if self.turn_starts is None:
            return np.zeros(self.tokens, np.int64)
        index = turn_index(self.turn_starts)  # counted over the whole step, so each response is shifted back
        present = self.lengths > 0
        return index - np.repeat(index[self.starts[present]], self.lengths[present])

    @cached_property
    def turns(self) -> np.ndarray:
        """(B,) the number of assistant turns of each response (0 without a valid token)."""
        counts = np.zeros(len(self.lengths), np.int64)
        counts[self.lengths > 0] = self.turn[self.last] + 1
        return counts

    @property
    def multi_turn(self) -> bool:
        """Some response has more than one assistant turn."""
        return self.turn_starts is not None and int(self.turn_starts.sum()) > int((self.lengths > 0).sum())

    @cached_property
    def last(self) -> np.ndarray:
        """(B',) index of the last valid token of each response that has one."""
        return (self.starts + self.lengths - 1)[self.lengths > 0]


# --------------------------------------------------------------------------- the critic


def explained_variance(values: np.ndarray | None, returns: np.ndarray | None) -> float | None:
    """1 − Var(R − V)/Var(R) (n − 1 in both, as verl's ``critic/vf_explained_var``); None without
    values, with fewer than 2 tokens, or when the returns do not vary."""
    if values is None or returns is None:
        return None
    return critic_by_group(values, returns, np.zeros(len(returns), np.int64), 1)[0]["explained_var"]


def critic_by_group(values: np.ndarray, returns: np.ndarray, group: np.ndarray, groups: int) -> list[dict]:
    """Per group 0 … groups−1 of the tokens (``group``: (N,) ids), the statistics of CRITIC_STATISTICS
    of the values V against the returns G (:func:`_critic_by_runs`)."""
    group = np.asarray(group)
    starts = np.flatnonzero(np.diff(group, prepend=-1)) if len(group) else np.zeros(0, np.int64)
    return _critic_by_runs(values, returns, starts, group[starts], groups)


def critic_by_position(values: np.ndarray, returns: np.ndarray, responses: Responses) -> dict[str, dict]:
    """bucket -> the statistics of :func:`_critic_by_runs`, for every bucket of BUCKETS (``all``: the
    deciles together), under :func:`enough_tokens`."""
    starts, decile = responses.decile_segments
    by_decile = _critic_by_runs(values, returns, starts, decile, len(DECILES), overall=True)
    last = responses.last
    (at_last,) = critic_by_group(values[last], returns[last], np.zeros(len(last), np.int64), 1)
    by_bucket = {**dict(zip(DECILES, by_decile)), "last": at_last, "all": by_decile[-1]}
    return {bucket: enough_tokens(stats) for bucket, stats in by_bucket.items()}


def enough_tokens(stats: dict) -> dict:
    """A bucket's statistics with its explained variance blanked (None) when it has fewer than
    MIN_EV_TOKENS tokens: the one rule of the position buckets, in the live metrics, ``summary``,
    ``summary --critic``, the plot and the view (the means stay: they are fine on few tokens)."""
    return stats if stats["tokens"] >= MIN_EV_TOKENS else {**stats, "explained_var": None}


def _critic_by_runs(
    values: np.ndarray, returns: np.ndarray, starts: np.ndarray, run_group: np.ndarray, groups: int, overall: bool = False
) -> list[dict]:
    """Per group, over its n tokens: tokens n, explained_var = 1 − Var(G − V)/Var(G) (n − 1; None
    when n < 2 or Var(G) = 0 to float64 rounding), mean |V − G|, mean G, mean V (None when n = 0);
    ``overall`` appends the same over every token.

    The tokens come in runs of one group (``starts``, with ``run_group`` the group of each run, every
    token in one run): one summing pass per moment, run by run, in float64, the data shifted by
    its mean so that a variance Σ(x − c)² − (Σ(x − c))²/n keeps its digits."""
    g = np.asarray(returns, dtype=np.float64)
    error = g - np.asarray(values, dtype=np.float64)
    if len(g):
        shift_g, shift_error = g.mean(), error.mean()
        g_shifted, error_shifted = g - shift_g, error - shift_error
        moments = np.stack([
            np.diff(np.append(starts, len(g))).astype(np.float64),
            np.add.reduceat(g_shifted, starts), np.add.reduceat(np.square(g_shifted), starts),
            np.add.reduceat(error_shifted, starts), np.add.reduceat(np.square(error_shifted), starts),
            np.add.reduceat(np.abs(error), starts),
        ])  # fmt: skip
    else:
        shift_g = shift_error = 0.0
        moments = np.zeros((6, 0))
    by_group = np.stack([np.bincount(run_group, weights=row, minlength=groups) for row in moments], axis=1)
    if overall:
        by_group = np.vstack([by_group, by_group.sum(axis=0)])
    rows = []
    for n, sum_g, square_g, sum_error, square_error, abs_error in by_group:
        tokens = int(n)
        spread_g = square_g - sum_g * sum_g / max(n, 1)
        spread_error = square_error - sum_error * sum_error / max(n, 1)
        varies = tokens >= 2 and spread_g > 1e-12 * square_g
        rows.append({
            "tokens": tokens,
            "explained_var": float(1.0 - spread_error / spread_g) if varies else None,
            "mean_abs_error": float(abs_error / n) if tokens else None,
            "mean_return": float(shift_g + sum_g / n) if tokens else None,
            "mean_value": float(shift_g + sum_g / n - shift_error - sum_error / n) if tokens else None,
        })  # fmt: skip
    return rows


def critic_by_turn(values: np.ndarray, returns: np.ndarray, responses: Responses) -> dict[str, dict]:
    """``turn{k}`` -> the statistics of :func:`critic_by_group` at the first token of every response's
    turn k, for k = 0 … K−1 (K: the most turns of a response), and ``after_hole`` -> the same over the
    first tokens of all turns k ≥ 1 (``responses`` with their ``turn_starts``), under :func:`enough_tokens`."""
    first = np.flatnonzero(responses.turn_starts)
    turn = responses.turn[first]
    turns = int(turn.max()) + 1 if len(turn) else 0
    by_turn = critic_by_group(values[first], returns[first], turn, turns)
    later = turn > 0
    (after_hole,) = critic_by_group(values[first][later], returns[first][later], np.zeros(int(later.sum()), np.int64), 1)
    by_bucket = {**{f"turn{k}": stats for k, stats in enumerate(by_turn)}, "after_hole": after_hole}
    return {bucket: enough_tokens(stats) for bucket, stats in by_bucket.items()}


# --------------------------------------------------------------------------- the credit


def credit_shares(advantage: np.ndarray, responses: Responses) -> dict[str, float | None]:
    """Where the credit lands, from the raw advantage A at the valid tokens:

    * top_token_share: the mean over responses (with Σ|A| > 0) of max_t |A_t| / Σ_t |A_t|: 1/L when
      the credit is spread evenly over a response, 1 when it sits on one token;
    * first_half_share: the share of the step's Σ|A| on the first half of each response (d0–d4,
      2i < L). None where no token carries credit."""
    magnitude = np.abs(np.asarray(advantage, dtype=np.float64))
    present = responses.lengths > 0
    starts = responses.starts[present]
    total = np.add.reduceat(magnitude, starts) if len(starts) else np.zeros(0)
    largest = np.maximum.reduceat(magnitude, starts) if len(starts) else np.zeros(0)
    credited = total > 0
    step_total = float(magnitude.sum())
    return {
        "top_token_share": float((largest[credited] / total[credited]).mean()) if credited.any() else None,
        "first_half_share": float(_first_half(magnitude, responses) / step_total) if step_total > 0 else None,
    }


def turn_shares(advantage: np.ndarray, responses: Responses) -> dict[str, float]:
    """``turn{k}`` -> the share of the step's Σ|A| on the tokens of turn k (of every response);
    {} where no token carries credit."""
    magnitude = np.abs(np.asarray(advantage, dtype=np.float64))
    total = float(magnitude.sum())
    if total <= 0:
        return {}
    return {f"turn{k}": float(share) for k, share in enumerate(np.bincount(responses.turn, weights=magnitude) / total)}


def _first_half(x: np.ndarray, responses: Responses) -> float:
    """Σ x over the first half of each response (deciles d0–d4)."""
    starts, decile = responses.decile_segments
    return float(np.add.reduceat(x, starts)[decile < 5].sum()) if len(starts) else 0.0


# --------------------------------------------------------------------------- advantages and groups


def standard_deviation(x: np.ndarray | None) -> float | None:
    """Std with n − 1 (as masked_whiten's variance); None with fewer than 2 numbers."""
    return float(np.asarray(x, dtype=np.float64).std(ddof=1)) if x is not None and len(x) > 1 else None


def mean(x: np.ndarray | None) -> float | None:
    return float(np.asarray(x, dtype=np.float64).mean()) if x is not None and len(x) else None


def prompt_groups(uid: Sequence) -> np.ndarray:
    """The prompt group of each response, numbered 0 … G−1 in order of first appearance (its uid's
    rank among the distinct uids, by first occurrence): B uids give (B,) int64."""
    _, first, group = np.unique(np.asarray([str(u) for u in uid]), return_index=True, return_inverse=True)
    # the order of appearance, not of the (random) uids: sums over groups come out the same to the bit
    return np.argsort(np.argsort(first))[group.reshape(-1)]


def group_score_std(scores: np.ndarray, uid: Sequence) -> float | None:
    """The mean over prompt groups (the responses of one ``uid``) with at least two responses of the
    std (n − 1) of their responses' scores; None without such a group."""
    group = prompt_groups(uid)
    scores = np.asarray(scores, dtype=np.float64)
    n = np.bincount(group)
    group_mean = np.bincount(group, weights=scores) / n
    spread = np.bincount(group, weights=np.square(scores - group_mean[group]))
    grouped = n >= 2
    return float(np.sqrt(spread[grouped] / (n[grouped] - 1)).mean()) if grouped.any() else None


# --------------------------------------------------------------------------- one step's metrics


def step_metrics(
    responses: Responses,
    *,
    returns: np.ndarray | None,
    values: np.ndarray | None,
    advantage_raw: np.ndarray | None,
    advantage: np.ndarray | None,
    scores: np.ndarray | None = None,
    uid: Sequence | None = None,
) -> dict[str, float]:
    """The live metrics of one step (names above, without PREFIX), from its compacted valid tokens:
    ``returns`` the Monte-Carlo return G, ``values`` V, ``advantage_raw`` before whitening,
    ``advantage`` what the update gets; ``scores`` (B,) each response's score and ``uid`` its prompt
    group. A quantity that is undefined on the step (no values, Var(G) = 0, a bucket of fewer than MIN_EV_TOKENS tokens,
    no group of two) is left out."""
    metrics: dict[str, float | None] = {}
    if values is not None and returns is not None:
        by_position = critic_by_position(values, returns, responses)
        metrics[EV_ALL] = by_position["all"]["explained_var"]
        metrics[EV_LAST] = by_position["last"]["explained_var"]
        metrics |= {EV_BUCKET.format(bucket=d): by_position[d]["explained_var"] for d in DECILES}
        if responses.multi_turn:
            by_turn = critic_by_turn(values, returns, responses)
            metrics |= {EV_BUCKET.format(bucket=bucket): stats["explained_var"] for bucket, stats in by_turn.items()}
    metrics[RAW_STD] = standard_deviation(advantage_raw)
    metrics[WHITEN_MEAN], metrics[WHITEN_STD] = mean(advantage), standard_deviation(advantage)
    if scores is not None and uid is not None and len(uid):
        metrics[GROUP_STD] = group_score_std(scores, uid)
    if advantage_raw is not None:
        shares = credit_shares(advantage_raw, responses)
        metrics[TOP_TOKEN_SHARE], metrics[FIRST_HALF_SHARE] = shares["top_token_share"], shares["first_half_share"]
        if responses.multi_turn:
            metrics |= {TURN_SHARE.format(turn=turn): share for turn, share in turn_shares(advantage_raw, responses).items()}
    return {name: value for name, value in metrics.items() if value is not None}


def prefixed(metrics: Mapping[str, float]) -> dict[str, float]:
    """The names verl's loggers show: ``verl_ext/critic/ev_mc``, …"""
    return {PREFIX + name: value for name, value in metrics.items()}

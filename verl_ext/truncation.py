"""Truncated responses (docs/definitions.md #truncated-responses): a response cut at the length
limit did not end; ``algorithm.truncation`` says what the estimators do at the cut.

* ``terminal`` (verl's behaviour, the default): V(s_L) = 0 for every response;
* ``bootstrap``: V(s_L) = the critic's value after the last token for a cut response (0 for one that
  ended); every estimator then uses it where it would use 0;
* ``mask``: a cut response gets advantage 0 on every token and is left out of the whitening
  statistics (DAPO's "overlong filtering"); its returns are the terminal ones.

A bootstrap is the terminal estimate on rewards whose last valid token is paid γ·V(s_L) more: every
estimator sees the value after the last token only through r_{L−1} + γ·V(s_L) (the last TD residual,
the last term of a discounted sum, the last turn's reward), so one rewrite of the rewards serves them
all, verl's own GAE included. Tensors in, tensors out, no verl import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from verl_ext.options import TRUNCATION_DEFAULT, TRUNCATION_MODES
from verl_ext.turns import turn_ends

__all__ = ["TRUNCATION_DEFAULT", "TRUNCATION_MODES", "VALUES_AFTER_LAST", "Truncation", "cut_responses"]

#: verl's batch key of V(s_L), (B,): the critic's value after each response's last valid token.
VALUES_AFTER_LAST = "values_after_last"


def last_valid_token(mask: torch.Tensor) -> torch.Tensor:
    """l_t = m_t ∧ (m_u = 0 for every u > t): the last valid token of each row, (B, T) -> (B, T) bool."""
    ends = turn_ends(mask)
    return ends & (ends.flip(-1).cumsum(-1).flip(-1) == 1)


def cut_responses(
    response_ids: torch.Tensor, mask: torch.Tensor, eos_token_ids: Sequence[int], max_response_length: int
) -> torch.Tensor:
    """c_b = (L_b = max_response_length) ∧ (y_{L_b−1} ∉ EOS), L_b = the last valid position + 1.

    response_ids, mask: (B, T) -> (B,) bool. A row without a valid token is not cut.
    """
    last = last_valid_token(mask)
    lengths = torch.where(last.any(-1), last.to(torch.int64).argmax(-1) + 1, 0)
    last_id = (response_ids * last).sum(-1)
    eos = torch.isin(last_id, torch.as_tensor(list(eos_token_ids), dtype=response_ids.dtype, device=response_ids.device))
    return (lengths == max_response_length) & (lengths > 0) & ~eos


def bootstrapped_rewards(
    r_t: torch.Tensor, mask: torch.Tensor, v_l: torch.Tensor, cut: torch.Tensor, gamma: float
) -> torch.Tensor:
    """r'_t = r_t + γ·V(s_L)·[t = L−1]·c_b: the rewards whose terminal estimate is the bootstrapped one.

    r_t, mask: (B, T); v_l, cut: (B,) -> (B, T), in r_t's dtype promoted to at least float32.
    """
    dtype = torch.promote_types(r_t.dtype, torch.float32)
    bonus = torch.where(cut, gamma * v_l.to(dtype), torch.zeros((), dtype=dtype, device=r_t.device))
    return r_t.to(dtype) + last_valid_token(mask) * bonus[:, None]


@dataclass(frozen=True)
class Truncation:
    """What the estimators do at the cut for one batch: ``mode`` (one of :data:`TRUNCATION_MODES`),
    ``cut`` (B,) bool, and ``bootstrap_value`` (B,) V(s_L) (``bootstrap`` only; read on cut rows only)."""

    mode: str
    cut: torch.Tensor
    bootstrap_value: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.mode not in TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {', '.join(TRUNCATION_MODES)}, got {self.mode!r}")
        if self.mode == "bootstrap" and self.bootstrap_value is None:
            raise ValueError("truncation=bootstrap needs V(s_L), the critic's value after each response's last token")

    def rewards(self, r_t: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
        """The rewards the terminal estimate runs on (bootstrapped rows rewritten, the rest as given)."""
        if self.mode != "bootstrap":
            return r_t
        return bootstrapped_rewards(r_t, mask, self.bootstrap_value.to(r_t.device), self.cut.to(r_t.device), gamma)

    def whitened_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """The tokens whose advantages make the whitening statistics: ``mask`` without cut rows under ``mask``."""
        if self.mode != "mask":
            return mask
        return mask * ~self.cut.to(mask.device)[:, None]

    def whiten(self, raw: torch.Tensor, mask: torch.Tensor, masked_whiten) -> torch.Tensor:
        """``masked_whiten(raw, mask)`` over :meth:`whitened_mask`, then :meth:`advantages`. Under ``mask``
        a batch left with fewer than two tokens outside its cut responses has no statistics (σ needs two)
        and no advantage: all 0, where ``terminal`` would whiten over every response."""
        kept = self.whitened_mask(mask)
        if self.mode == "mask" and int((kept != 0).sum()) < 2:
            return torch.zeros_like(raw)
        return self.advantages(masked_whiten(raw, kept))

    def advantages(self, advantages: torch.Tensor) -> torch.Tensor:
        """The advantages the actor trains on: 0 on every token of a cut row under ``mask``."""
        if self.mode != "mask":
            return advantages
        return torch.where(self.cut.to(advantages.device)[:, None], torch.zeros_like(advantages), advantages)

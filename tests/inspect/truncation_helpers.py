"""Synthetic traces of runs that treat truncated responses apart (docs/definitions.md#truncated-responses),
with expected values from direct sums that carry V(s_L) explicitly (never the rewards rewrite of
verl_ext.truncation) and verl's own masked_whiten. Written by the real TraceWriter, with the
estimate's Truncation handed to the capture as a run hands it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

import tests.support.reference as ref
from tests.inspect.inspect_helpers import EOS, Batch, whiten, write_trace
from verl_ext.truncation import Truncation

T = 10
#: Rows of :func:`cut_batch`: (length, hole at positions 2-3, ends on EOS). Cut: length T and no EOS.
ROWS = ((T, False, False), (T, True, False), (6, False, False), (T, False, True), (7, True, False), (T, True, False))
CUT = [length == T and not eos for length, _, eos in ROWS]  # rows 0, 1 and 5


def cut_batch(seed: int, kl_coef: float | None = None) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """(batch, cut (B,) bool, V(s_L) (B,)): responses cut at T, with and without holes, ended ones at
    T (on EOS) and shorter; an outcome score on the last valid token plus a small per-token one, junk
    at masked positions."""
    g = torch.Generator().manual_seed(seed)
    B = len(ROWS)
    mask = torch.zeros(B, T)
    responses = torch.randint(7, 20, (B, T), generator=g)
    for b, (length, hole, eos) in enumerate(ROWS):
        mask[b, :length] = 1
        if hole:
            mask[b, 2:4] = 0
        if eos:
            responses[b, length - 1] = EOS
    last = (mask * (torch.arange(T) + 1)).argmax(dim=1)
    scores = (torch.rand(B, T, generator=g) * 0.2 - 0.1) * mask
    scores[torch.arange(B), last] += torch.randint(0, 2, (B,), generator=g).float()
    values = (torch.rand(B, T, generator=g) * 2 - 0.5) * mask + 100.0 * (1 - mask)
    kl = None if kl_coef is None else torch.rand(B, T, generator=g).mul(0.2).sub(0.05) * mask
    rewards = scores if kl is None else scores - kl_coef * kl
    prompts = torch.randint(7, 20, (B, 4), generator=g)
    batch = Batch(mask, responses, prompts, torch.ones(B, 4, dtype=torch.bool), scores, kl, rewards, values, kl_coef=kl_coef)
    v_l = torch.rand(B, generator=g) * 2 - 0.5
    return batch, torch.tensor(CUT), v_l


def row_sums(name: str, r: list[float], v: list[float], v_l: float, gamma: float, lam: float = 1.0, n: int | None = None):
    """(returns, raw advantage) of one row's valid tokens, V after the last one = ``v_l``, from
    tests/support/reference.py's direct sums (``gae``: GAE(γ, λ); every other name by its own sum)."""
    if name in ("mc", "td0", "nstep"):
        g = {"mc": lambda: ref.mc_row(r, gamma, v_l), "td0": lambda: ref.td0_row(r, v, gamma, v_l),
             "nstep": lambda: ref.nstep_row(r, v, gamma, n, v_l)}[name]()  # fmt: skip
        return list(g), [gi - vi for gi, vi in zip(g, v)]
    a = ref.gae_row(r, v, gamma, lam, v_l)
    return [ai + vi for ai, vi in zip(a, v)], list(a)


def by_definition(
    batch: Batch, cut: torch.Tensor, v_l: torch.Tensor, mode: str, name: str, gamma: float,
    lam: float = 1.0, n: int | None = None, whitened: bool = True,
) -> Batch:  # fmt: skip
    """Returns, raw advantages and advantages of ``mode``: a cut row's V after its last token is
    ``v_l`` under bootstrap, 0 otherwise; under mask its advantages are 0 and the whitening is over the
    rows not cut (verl's masked_whiten). ``turn_gae``: returns GAE(λ) per token, raw advantage the
    A_k of each turn."""
    B, _ = batch.mask.shape
    returns, raw = torch.full((B, T), 55.0), torch.full((B, T), -55.0)  # junk at masked positions
    for b in range(B):
        idx = torch.nonzero(batch.mask[b]).flatten().tolist()
        r = [float(batch.rewards[b, i]) for i in idx]
        v = [float(batch.values[b, i]) for i in idx]
        after = float(v_l[b]) if mode == "bootstrap" and cut[b] else 0.0
        g, a = row_sums(name, r, v, after, gamma, lam, n)
        if name == "turn_gae":
            a = ref.turn_gae_row(batch.rewards[b].tolist(), batch.values[b].tolist(), batch.mask[b].tolist(), gamma, lam, after)[idx]
        returns[b, idx] = torch.tensor(g, dtype=torch.float64).float()
        raw[b, idx] = torch.tensor(a, dtype=torch.float64).float()
    kept = batch.mask * ~cut[:, None] if mode == "mask" else batch.mask
    advantages = whiten(raw, kept) if whitened else raw.clone()
    if mode == "mask":
        advantages = torch.where(cut[:, None], torch.zeros_like(advantages), advantages)
    return replace(batch, returns=returns, advantage_raw=raw, advantages=advantages)


def write(
    directory: Path, algo: dict, steps: dict[int, tuple[Batch, Truncation | None]], max_samples: int | None = None
) -> str:
    """A trace of ``steps`` (batch and the estimate's Truncation, None: terminal) by the real writer."""
    batches = {step: b for step, (b, _) in steps.items()}
    truncations = {step: truncation for step, (_, truncation) in steps.items()}
    return write_trace(directory, algo, batches, max_samples, truncations=truncations, ends=((EOS,), T))


def truncation_of(mode: str, cut: torch.Tensor, v_l: torch.Tensor) -> Truncation | None:
    """The Truncation a run of ``mode`` hands the capture (None: terminal)."""
    if mode == "terminal":
        return None
    return Truncation(mode, cut, v_l if mode == "bootstrap" else None)

"""The advantage estimators as formulas: tensors in, tensors out, no verl import.

Conventions (docs/definitions.md §1, §3, §7), for every function here:

* Tensors are ``(B, T)``: B responses, T the padded response length. ``mask`` is 1 on trainable
  tokens and 0 on padding and on interior observation/tool tokens.
* Time-indexed names: ``r_t`` is the reward paid for token t, ``v_t`` is V(s_t), the value of the
  state *before* token t (so V(s_t) includes r_t), ``v_tp1`` is V(s_{t+1}).
* Each row is computed on its L valid tokens t = 0 … L−1 (masked positions are skipped: "t+1" is
  the next valid token), with V(s_L) = 0: no bootstrap past the response. Outputs at masked
  positions are unspecified, as in verl: losses mask them.
* ``gamma`` is a float; ``lam`` a float or a ``(B,)`` tensor (one λ per response).
* Each estimator returns ``(returns, advantage)``: the critic's target and the raw (unwhitened)
  advantage; :func:`masked_whiten` makes the advantage the actor trains on.
* The first paragraph of each estimator's docstring is its formula, the one place it is written:
  the registry's entry shows it (:func:`verl_ext.builtin_estimators.docstring_formula`, ``verl-ext doctor``).

The formulas inside each function are written on compacted rows; :func:`verl_ext.kernels.on_valid_tokens`
does the compaction and the row grouping, :func:`verl_ext.kernels.discounted_sum` the scan,
:class:`verl_ext.kernels.Turns` the turns (maximal runs of valid tokens) of :func:`turn_gae`.
"""

from __future__ import annotations

import torch

from verl_ext.kernels import (
    Turns,
    discounted_sum,
    inverse_std,
    masked_moments,
    on_valid_tokens,
    scaled,
    shifted,
)
from verl_ext.turns import turn_starts

Pair = tuple[torch.Tensor, torch.Tensor]


def mc(r_t: torch.Tensor, v_t: torch.Tensor, mask: torch.Tensor, gamma: float) -> Pair:
    """Monte-Carlo return minus value:  G_t = Σ_{k=t}^{L−1} γ^{k−t} r_k;  returns = G_t;  advantage = G_t − V(s_t).

    r_t, v_t, mask: (B, T) -> returns, advantage: (B, T).
    """

    r_t, v_t = _floats(r_t, v_t, mask)
    (g_t,) = on_valid_tokens(lambda r_t: discounted_sum(r_t, gamma), mask, r_t)
    return g_t, g_t - v_t


def td0(r_t: torch.Tensor, v_t: torch.Tensor, mask: torch.Tensor, gamma: float) -> Pair:
    """One-step TD:  returns = r_t + γ V(s_{t+1});  advantage = δ_t = r_t + γ V(s_{t+1}) − V(s_t).

    r_t, v_t, mask: (B, T) -> returns, advantage: (B, T).
    """

    r_t, v_t = _floats(r_t, v_t, mask)
    (target,) = on_valid_tokens(lambda r_t, v_t: r_t + gamma * shifted(v_t, 1), mask, r_t, v_t)
    return target, target - v_t


def nstep(r_t: torch.Tensor, v_t: torch.Tensor, mask: torch.Tensor, gamma: float, n: int) -> Pair:
    """n-step bootstrapped return:  G_t^(n) = Σ_{k=t}^{min(t+n,L)−1} γ^{k−t} r_k + γ^n V(s_{t+n}) [t+n < L];
    returns = G_t^(n);  advantage = G_t^(n) − V(s_t).

    r_t, v_t, mask: (B, T) -> returns, advantage: (B, T).
    """
    _check_n(n)

    r_t, v_t = _floats(r_t, v_t, mask)

    def formula(r_t, v_t):
        # G_t − γ^n G_{t+n} in float64: the subtraction loses nothing at float32 precision even
        # for long undiscounted responses. G and V past L are 0, so the bootstrap stops there.
        g_t = discounted_sum(r_t.double(), gamma)
        decay = float(gamma) ** n
        return g_t - decay * shifted(g_t, n) + decay * shifted(v_t.double(), n)

    (target,) = on_valid_tokens(formula, mask, r_t, v_t)
    return target, target - v_t


def gae(r_t: torch.Tensor, v_t: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float | torch.Tensor) -> Pair:
    """GAE(γ, λ):  δ_t = r_t + γ V(s_{t+1}) − V(s_t);  A_t = Σ_{l≥0} (γλ)^l δ_{t+l};
    returns = A_t + V(s_t) (the λ-return);  advantage = A_t.

    r_t, v_t, mask: (B, T); lam a float or (B,) -> returns, advantage: (B, T).
    """
    _check_lam(lam, r_t.shape[0])

    r_t, v_t = _floats(r_t, v_t, mask)

    def formula(r_t, v_t, lam):
        return discounted_sum(_td_residual(r_t, v_t, gamma), gamma * lam)

    (a_t,) = on_valid_tokens(formula, mask, r_t, v_t, lam=_lam(lam, r_t))
    return a_t + v_t, a_t


def gae_decoupled(
    r_t: torch.Tensor,
    v_t: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam_critic: float,
    lam_actor: float | torch.Tensor,
) -> Pair:
    """GAE with decoupled λ (VC-PPO, arXiv 2503.01491):
    returns = GAE(γ, λ_critic) + V(s_t);  advantage = GAE(γ, λ_actor), both from the same δ_t.

    r_t, v_t, mask: (B, T); lam_actor a float or (B,) -> returns, advantage: (B, T).
    """
    _check_lam(lam_actor, r_t.shape[0])

    r_t, v_t = _floats(r_t, v_t, mask)

    def formula(r_t, v_t, lam_actor):
        delta_t = _td_residual(r_t, v_t, gamma)
        return discounted_sum(delta_t, gamma * lam_critic), discounted_sum(delta_t, gamma * lam_actor)

    a_critic, a_actor = on_valid_tokens(formula, mask, r_t, v_t, lam_actor=_lam(lam_actor, r_t))
    return a_critic + v_t, a_actor


def turn_gae(
    r_t: torch.Tensor,
    v_t: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
    lam_critic: float,
) -> Pair:
    """Turn-level GAE: each assistant turn k = 0 … K−1 (a maximal run of valid tokens) is one action.
    R_k = Σ_{t ∈ turn k} r_t;  V_k = V(s_t) at the turn's first token;  V_K = 0;
    δ_k = R_k + γ V_{k+1} − V_k;  A_k = Σ_{l≥0} (γλ)^l δ_{k+l};  advantage = A_k on every token of turn k;
    returns = GAE(γ, λ_critic) + V(s_t), token by token (the critic keeps a per-token target).

    r_t, v_t, mask: (B, T); lam a float or (B,) -> returns, advantage: (B, T).
    """
    _check_lam(lam, r_t.shape[0])

    r_t, v_t = _floats(r_t, v_t, mask)

    def formula(r_t, v_t, start_t, lam):
        turns = Turns(start_t)
        r_k, v_k = turns.sum(r_t), turns.at_first_token(v_t)
        a_k = discounted_sum(r_k + gamma * shifted(v_k, 1) - v_k, gamma * lam)
        return discounted_sum(_td_residual(r_t, v_t, gamma), gamma * lam_critic), turns.spread(a_k.to(r_t.dtype))

    a_critic, a_actor = on_valid_tokens(formula, mask, r_t, v_t, turn_starts(mask), lam=_lam(lam, r_t))
    return a_critic + v_t, a_actor


def length_adaptive_lam(mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """λ_b = clamp(1 − 1/(α·L_b), 0, 1), L_b the number of valid tokens (VAPO, arXiv 2504.05118).

    mask (B, T) -> (B,) float64, whatever the rewards' dtype: the discount γ·λ_b is formed from it in
    float64 and rounded once, to the dtype the discounted sum runs in (λ_b and γ·λ_b each rounded to
    float32 were 1e-6 from the float64 formula at L = 512, for float64 inputs too). A response with
    no valid token gets λ = 0.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    lengths = (mask != 0).sum(dim=1).to(torch.float64)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x − μ) / sqrt(σ² + 1e-8), μ = Σx/n and σ² = Σ(x − μ)²/(n − 1) over the n valid entries of
    the whole batch.

    x, mask: (B, T) -> (B, T). What verl's ``verl.utils.torch_functional.masked_whiten`` computes with
    verl's integer response mask (:data:`verl_ext.kernels.WHITEN_EPS` says why its 1e-8 in the means'
    count vanishes), with its errors for fewer than two valid entries; the moments are accumulated
    in float64, so results agree with verl's to float32 rounding.
    """
    return whitened_with_moments(x, mask)[0]


def whitened_with_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """(:func:`masked_whiten`'s result, μ, σ²): the statistics it whitened with, computed once."""
    count, mean, m2 = masked_moments(x, mask)
    if count == 0:
        raise ValueError("At least one element in the mask has to be 1.")
    if count == 1:
        raise ValueError("The sum of the mask is one, which can cause a division by zero.")
    return scaled(x, mean, inverse_std(m2, count)), mean, m2 / (count - 1)


def whitening_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[int, float, float]:
    """(n, μ, σ²) of the valid entries of (B, T): the statistics :func:`masked_whiten` uses
    (σ² unbiased, nan when n < 2)."""
    count, mean, m2 = masked_moments(x, mask)
    return count, mean, m2 / (count - 1) if count > 1 else float("nan")


def _td_residual(r_t: torch.Tensor, v_t: torch.Tensor, gamma: float) -> torch.Tensor:
    """δ_t = r_t + γ V(s_{t+1}) − V(s_t) on compacted rows (V past the last valid token is 0)."""
    return r_t + gamma * shifted(v_t, 1) - v_t


# --------------------------------------------------------------------------- input checks


def _floats(r_t: torch.Tensor, v_t: torch.Tensor | None, mask: torch.Tensor):
    """Check shapes; r_t and v_t in one float dtype of at least float32 precision (verl's CPU critic
    can hand over bfloat16 values; sums over a response need float32)."""
    if r_t.dim() != 2:
        raise ValueError(f"rewards must be (B, T), got shape {tuple(r_t.shape)}")
    for name, t in (("values", v_t), ("response_mask", mask)):
        if t is not None and t.shape != r_t.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, rewards {tuple(r_t.shape)}")
    dtype = torch.promote_types(r_t.dtype, torch.float32)
    if v_t is None:
        return r_t.to(dtype), torch.zeros_like(r_t, dtype=dtype)
    dtype = torch.promote_types(dtype, v_t.dtype)
    return r_t.to(dtype), v_t.to(dtype)


def _lam(lam: float | torch.Tensor, like: torch.Tensor) -> float | torch.Tensor:
    return lam.to(device=like.device) if isinstance(lam, torch.Tensor) else lam


def _check_n(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")


def _check_lam(lam, batch: int) -> None:
    if isinstance(lam, torch.Tensor) and lam.shape != (batch,):
        raise ValueError(f"per-response lam must have shape ({batch},), got {tuple(lam.shape)}")

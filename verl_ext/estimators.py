"""Value-based advantage estimators as pure tensor functions (no verl import).

Conventions (docs/definitions.md §1, §5 and §7), for every function here:

* Tensors are ``(B, T)``: B responses, T the padded response length. ``response_mask`` is 1 on
  trainable tokens and 0 on padding and on interior observation/tool tokens.
* ``values[:, t]`` is V(s_t), the value of the state *before* token t; ``rewards[:, t]`` is r_t,
  paid for token t. V(s_t) therefore includes r_t.
* Masked positions are skipped: each row is compacted to its L valid tokens, computed on that
  sequence with V_L = 0 (no bootstrap past the response), and scattered back. Outputs at masked
  positions are unspecified, as in verl: they are not part of the contract and losses mask them.
* ``gamma`` is a float; ``lam`` is a float or a ``(B,)`` tensor (one λ per response).

Everything is vectorised over time. The only Python loops run over the log_K(T) block levels of
the discounted scan and over cache-sized groups of rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from verl_ext.options import EstimatorOptions

#: Block length K of the blocked discounted scan. The in-block matrix product costs K
#: multiply-adds per token; 16 measured fastest on one CPU core (benchmarks/bench_estimators.py).
SCAN_BLOCK = 16


@dataclass(frozen=True)
class Estimate:
    """What an estimator produces, all ``(B, T)``.

    ``advantage_raw`` is the advantage before whitening; ``advantages`` is what the actor trains
    on (whitened when whitening is on); ``returns`` is the critic's regression target.
    """

    advantages: torch.Tensor
    returns: torch.Tensor
    advantage_raw: torch.Tensor


# --------------------------------------------------------------------------- building blocks


def discounted_reverse_cumsum(x: torch.Tensor, discount: float | torch.Tensor) -> torch.Tensor:
    """y_t = Σ_{k=t}^{T-1} d^{k-t} x_k   along the last axis.

    x: (B, T); discount d: a float or a (B,) tensor (one discount per row). Returns (B, T).

    Computed exactly as the direct sums, block by block: within each block of
    :data:`SCAN_BLOCK` positions one matrix product with the triangular matrix of powers
    d^{j-i}; across blocks the same scan, recursively, on the block heads with discount d^K.
    """
    if x.dim() != 2:
        raise ValueError(f"x must be (B, T), got shape {tuple(x.shape)}")
    batch, length = x.shape
    d = _discount_tensor(discount, batch, x)
    if length == 0:
        return x.clone()
    k = min(SCAN_BLOCK, length)
    n_blocks = -(-length // k)
    if n_blocks * k != length:
        x = torch.nn.functional.pad(x, (0, n_blocks * k - length))
    blocks = x.reshape(batch, n_blocks, k)
    # (B, n_blocks, K) @ (K, K) or @ (B, K, K): the direct discounted sum inside each block
    local = torch.matmul(blocks, _power_matrix(d, k).transpose(-1, -2))
    if n_blocks > 1:
        # y at the first position of every block, then carried into the block before it
        starts = discounted_reverse_cumsum(local[:, :, 0], d**k)
        next_start = torch.nn.functional.pad(starts[:, 1:], (0, 1))
        tail_decay = d.unsqueeze(-1) ** torch.arange(k, 0, -1, dtype=x.dtype, device=x.device)  # d^(K-i)
        local += next_start.unsqueeze(-1) * (tail_decay.unsqueeze(1) if d.dim() else tail_decay)
    return local.view(batch, n_blocks * k)[:, :length]


def _discount_tensor(discount: float | torch.Tensor, batch: int, like: torch.Tensor) -> torch.Tensor:
    d = torch.as_tensor(discount, dtype=like.dtype, device=like.device)
    if d.dim() == 1 and d.shape[0] != batch:
        raise ValueError(f"per-row discount has {d.shape[0]} entries for {batch} rows")
    if d.dim() > 1:
        raise ValueError(f"discount must be a float or a (B,) tensor, got shape {tuple(d.shape)}")
    return d


def _power_matrix(d: torch.Tensor, size: int) -> torch.Tensor:
    """M[i, j] = d^{j-i} for j >= i, else 0; (size, size), or (B, size, size) for a (B,) d."""
    idx = torch.arange(size, device=d.device)
    exponent = (idx.unsqueeze(0) - idx.unsqueeze(1)).to(d.dtype)  # j - i
    upper = exponent >= 0
    base = d.view(-1, 1, 1) if d.dim() else d
    return torch.where(upper, base ** exponent.clamp(min=0), torch.zeros((), dtype=d.dtype, device=d.device))


class Compaction:
    """Moves each row's valid tokens next to each other, in order, and back again.

    In the compacted layout the L_b valid entries of row b sit in columns 1 … L_b of a zero
    buffer, and every masked token is parked in column 0. A reverse scan over the buffer is the
    computation on the compacted sequence with V_L = 0: the zeros after column L_b are exactly
    the terminal state, and no output at a column >= 1 depends on column 0, which is cleared.
    """

    def __init__(self, response_mask: torch.Tensor):
        if response_mask.dim() != 2:
            raise ValueError(f"response_mask must be (B, T), got shape {tuple(response_mask.shape)}")
        self.valid = response_mask.bool()
        self.column = torch.cumsum(self.valid, dim=1).mul_(self.valid)  # 1-based rank if valid, else 0
        self.width = -(-(response_mask.shape[1] + 1) // SCAN_BLOCK) * SCAN_BLOCK  # >= T+1, whole blocks

    def gather(self, x: torch.Tensor, extra: int = 0) -> torch.Tensor:
        """(B, T) -> (B, width + extra) compacted buffer."""
        buffer = x.new_zeros(x.shape[0], self.width + extra).scatter_(1, self.column, x)
        buffer[:, 0] = 0  # masked tokens' values (possibly inf/nan) must not reach the scan
        return buffer

    def scatter(self, buffer: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Compacted buffer -> (B, T) (into ``out`` if given); masked positions get unspecified values."""
        return torch.gather(buffer, 1, self.column, out=out)


def _float_inputs(rewards: torch.Tensor, values: torch.Tensor | None, response_mask: torch.Tensor):
    """Check shapes; return rewards and values in one float dtype of at least float32 precision.

    verl's CPU critic can hand over bfloat16 values; sums over a response need float32.
    """
    if rewards.dim() != 2:
        raise ValueError(f"token_level_rewards must be (B, T), got shape {tuple(rewards.shape)}")
    for name, t in (("values", values), ("response_mask", response_mask)):
        if t is not None and t.shape != rewards.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, token_level_rewards {tuple(rewards.shape)}")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    if values is not None:
        dtype = torch.promote_types(dtype, values.dtype)
    return rewards.to(dtype), None if values is None else values.to(dtype)


#: Rows are processed in groups of about this many tokens, so that every intermediate tensor
#: stays in the CPU cache: at B x T = 512 x 4096 this is 2-3x faster than whole-batch tensors,
#: and the extra memory stays a small fraction of the inputs (benchmarks/bench_estimators.py).
ROW_GROUP_TOKENS = 1 << 19


def row_groups(batch: int, length: int) -> list[slice]:
    rows = max(1, ROW_GROUP_TOKENS // max(1, length))
    return [slice(start, start + rows) for start in range(0, batch, rows)] or [slice(0, 0)]


def _per_row_group(compute, like: torch.Tensor) -> torch.Tensor:
    """Assemble ``compute(rows)`` (a (rows, T) tensor per row group) into a tensor like ``like``."""
    groups = row_groups(*like.shape)
    if len(groups) == 1:
        return compute(slice(None))
    out = torch.empty_like(like)
    for rows in groups:
        out[rows] = compute(rows)
    return out


# --------------------------------------------------------------------------- kernels on compacted rows


# Each kernel takes one group of rows and its Compaction, and writes into ``out`` when given
# (saving a copy of the result into the caller's output tensor).


def _mc(c: Compaction, r: torch.Tensor, gamma: float, out=None) -> torch.Tensor:
    return c.scatter(discounted_reverse_cumsum(c.gather(r), gamma), out)


def _td0(c: Compaction, r: torch.Tensor, v: torch.Tensor, gamma: float, out=None) -> torch.Tensor:
    return c.scatter(torch.add(c.gather(r), c.gather(v, extra=1)[:, 1:], alpha=gamma), out)


def _nstep(c: Compaction, r: torch.Tensor, v: torch.Tensor, gamma: float, n: int, out=None) -> torch.Tensor:
    # G_t - γ^n G_{t+n} in float64, so the subtraction loses nothing at float32 precision even
    # for long undiscounted responses; G_{t+n} and V_{t+n} are 0 beyond L (zero-padded rows).
    g = discounted_reverse_cumsum(c.gather(r.double()), gamma)
    v = c.gather(v.double())
    ahead = min(n, g.shape[1])
    g_ahead = torch.nn.functional.pad(g[:, n:], (0, ahead))
    v_ahead = torch.nn.functional.pad(v[:, n:], (0, ahead))
    decay = float(gamma) ** n
    result = (g - decay * g_ahead + decay * v_ahead).to(r.dtype)
    return c.scatter(result, out)


def _gae(c: Compaction, r: torch.Tensor, v: torch.Tensor, gamma: float, lam: float | torch.Tensor, out=None):
    v = c.gather(v, extra=1)
    delta = torch.add(c.gather(r), v[:, 1:], alpha=gamma).sub_(v[:, :-1])
    discount = gamma * (lam.to(r.dtype) if isinstance(lam, torch.Tensor) else lam)
    return c.scatter(discounted_reverse_cumsum(delta, discount), out)


# --------------------------------------------------------------------------- returns and advantages


def mc_returns(rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = Σ_{k=t}^{L-1} γ^{k-t} r_k   (Monte-Carlo return; shapes (B, T) -> (B, T))."""
    rewards, _ = _float_inputs(rewards, None, response_mask)
    return _per_row_group(lambda g: _mc(Compaction(response_mask[g]), rewards[g], gamma), rewards)


def td0_returns(rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """r_t + γ V_{t+1}, with V_L = 0   (one-step TD target; shapes (B, T) -> (B, T))."""
    rewards, values = _float_inputs(rewards, values, response_mask)
    return _per_row_group(lambda g: _td0(Compaction(response_mask[g]), rewards[g], values[g], gamma), rewards)


def nstep_returns(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, n: int
) -> torch.Tensor:
    """G_t^(n) = Σ_{k=t}^{min(t+n,L)-1} γ^{k-t} r_k + γ^n V_{t+n} [t+n < L]   (shapes (B, T) -> (B, T))."""
    rewards, values = _float_inputs(rewards, values, response_mask)
    _check_n(n)
    return _per_row_group(lambda g: _nstep(Compaction(response_mask[g]), rewards[g], values[g], gamma, n), rewards)


def gae_advantages(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float | torch.Tensor
) -> torch.Tensor:
    """A_t = Σ_{l>=0} (γλ)^l δ_{t+l},  δ_t = r_t + γ V_{t+1} - V_t,  V_L = 0.

    Shapes (B, T) -> (B, T); ``lam`` a float or a (B,) tensor (per-response λ). Unwhitened.
    """
    rewards, values = _float_inputs(rewards, values, response_mask)
    _check_lam(lam, rewards.shape[0])

    def compute(g):
        return _gae(Compaction(response_mask[g]), rewards[g], values[g], gamma, _rows(lam, g))

    return _per_row_group(compute, rewards)


def length_adaptive_lam(response_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """λ_b = clamp(1 - 1/(α·L_b), 0, 1), L_b the number of valid tokens (VAPO, arXiv 2504.05118).

    response_mask (B, T) -> (B,) float32. A response with no valid token gets λ = 0.
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    lengths = response_mask.bool().sum(dim=1).to(torch.float32)
    return (1.0 - 1.0 / (alpha * lengths)).clamp(0.0, 1.0)


def _rows(lam: float | torch.Tensor, rows: slice) -> float | torch.Tensor:
    return lam[rows] if isinstance(lam, torch.Tensor) else lam


def _check_n(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")


def _check_lam(lam, batch: int) -> None:
    if isinstance(lam, torch.Tensor) and lam.shape != (batch,):
        raise ValueError(f"per-response lam must have shape ({batch},), got {tuple(lam.shape)}")


# --------------------------------------------------------------------------- whitening


class _Moments:
    """Count, mean and Σ(x - mean)² of the valid entries, merged over row groups (Chan et al.)."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def add(self, x: torch.Tensor, valid: torch.Tensor) -> None:
        values = x.masked_select(valid).float()  # squares of bfloat16 values need float32
        n = values.numel()
        if n == 0:
            return
        mean = float(values.sum(dtype=torch.float64)) / n
        m2 = float((values - mean).square_().sum(dtype=torch.float64))
        total = self.count + n
        delta = mean - self.mean
        self.m2 += m2 + delta * delta * self.count * n / total
        self.mean += delta * n / total
        self.count = total

    @property
    def variance(self) -> float:
        """Unbiased (n − 1) variance; nan for fewer than two entries."""
        return self.m2 / (self.count - 1) if self.count > 1 else float("nan")

    def whiten(self, x: torch.Tensor) -> torch.Tensor:
        if self.count == 0:
            raise ValueError("At least one element in the mask has to be 1.")
        if self.count == 1:
            raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        scale = (self.variance + 1e-8) ** -0.5
        return _per_row_group(lambda g: (x[g] - self.mean).mul_(scale), x)


def _batch_moments(values: torch.Tensor, response_mask: torch.Tensor) -> _Moments:
    moments = _Moments()
    for rows in row_groups(*values.shape):
        moments.add(values[rows], response_mask[rows].bool())
    return moments


def whitening_moments(values: torch.Tensor, response_mask: torch.Tensor) -> tuple[int, float, float]:
    """(n, μ, σ²) of the valid entries of a (B, T) batch: the statistics :func:`masked_whiten` uses.

    σ² is the unbiased variance (nan when n < 2). verl's formula adds 1e-8 to n, which changes
    nothing at float32 precision.
    """
    moments = _batch_moments(values, response_mask)
    return moments.count, moments.mean, moments.variance


def masked_whiten(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(x - μ) / sqrt(σ² + 1e-8), μ and unbiased σ² over the valid entries of the whole batch.

    Shapes (B, T) -> (B, T); the mask is 0/1. The formula of verl's
    ``verl.utils.torch_functional.masked_whiten``, with its errors for fewer than two valid
    entries; the moments are accumulated in float64 over row groups, so results agree with
    verl's to float32 rounding (tests check this).
    """
    return _batch_moments(values, response_mask).whiten(values)


# --------------------------------------------------------------------------- the estimators by name


def estimate(
    rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, options: "EstimatorOptions"
) -> Estimate:
    """Returns and advantages of the estimator ``options.name`` (docs/definitions.md §5), all (B, T).

    mc: returns = G;  td0: returns = r + γV';  nstep: returns = G^(n);  raw advantage = returns − V.
    gae_ext: raw advantage = GAE(γ, λ_actor), returns = GAE(γ, λ_critic) + V (one GAE when the
    two λ agree). advantages = masked_whiten(raw advantage) unless whitening is off.

    One pass over row groups computes returns, the raw advantage and the whitening moments
    while a group's tensors are in cache; a second pass whitens.
    """
    rewards, values = _float_inputs(rewards, values, response_mask)
    name, gamma = options.name, options.gamma
    if name not in ("mc", "td0", "nstep", "gae_ext"):
        raise ValueError(f"unknown estimator {name!r}")
    if name == "nstep":
        _check_n(options.n_step)
    actor_lam = options.actor_lam
    if name == "gae_ext" and options.lam_length_alpha is not None:
        actor_lam = length_adaptive_lam(response_mask, options.lam_length_alpha).to(rewards.device)

    returns, raw = torch.empty_like(rewards), torch.empty_like(rewards)
    moments = _Moments()
    for rows in row_groups(*rewards.shape):
        c, r, v = Compaction(response_mask[rows]), rewards[rows], values[rows]
        if name == "gae_ext":
            _gae(c, r, v, gamma, _rows(actor_lam, rows), out=raw[rows])
            critic_advantage = raw[rows] if options.single_lambda else _gae(c, r, v, gamma, options.critic_lam)
            torch.add(critic_advantage, v, out=returns[rows])
        else:
            if name == "mc":
                _mc(c, r, gamma, out=returns[rows])
            elif name == "td0":
                _td0(c, r, v, gamma, out=returns[rows])
            else:
                _nstep(c, r, v, gamma, options.n_step, out=returns[rows])
            torch.sub(returns[rows], v, out=raw[rows])
        if options.whiten_advantages:
            moments.add(raw[rows], c.valid)
    advantages = moments.whiten(raw) if options.whiten_advantages else raw
    return Estimate(advantages=advantages, returns=returns, advantage_raw=raw)

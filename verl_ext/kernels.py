"""The speed machinery under :mod:`verl_ext.estimators`: compaction, the blocked scan, row groups.

None of this changes what is computed; it decides how fast. The estimators' formulas are written
on *compacted rows* and handed to :func:`on_valid_tokens`, which

1. splits the batch into groups of rows of about :data:`ROW_GROUP_TOKENS` tokens, so that every
   intermediate tensor of a group stays in the CPU cache (2-3x faster than whole-batch tensors at
   B × T = 512 × 4096, benchmarks/bench_estimators.py);
2. compacts each group (:class:`Compaction`): the L valid tokens of a row move to columns 1 … L of a
   zero buffer, masked tokens are parked in column 0. On that layout "the next token" is simply the
   next column, and the zeros after column L are the terminal state (V_L = 0, no reward after L);
3. runs the formula, and scatters its outputs back to the (B, T) positions of the valid tokens.
   Masked positions receive unspecified values, as in verl.

A formula over turns (maximal runs of valid tokens, docs/definitions.md §7) gets the turns' first
tokens as one more compacted input (:func:`verl_ext.turns.turn_starts`) and works on the turn axis
with :class:`Turns`: per-turn sums and first values by scatter, the turn-level scan with the same
:func:`discounted_sum`, and the result spread back to the turns' tokens by a gather.

:func:`discounted_sum` is the one non-trivial kernel: y_t = Σ_{k≥t} d^{k−t} x_k computed exactly as
the direct sum, block by block: no Python loop over T.

Float32 exactness does not depend on the process's matmul precision. Training scripts often call
``torch.set_float32_matmul_precision("high")`` (TF32 on CUDA: float32 operands rounded to a 10-bit
mantissa; "medium" may use bfloat16, also on CPU), which would cost a float32 matrix product three
digits. So the in-block sums never go through a float32 matrix product: on CUDA they are one
float64 matrix product (:func:`_scan_by_product`; no reduced-precision mode applies to float64),
elsewhere a recurrence over the K positions of a block (:func:`_scan_by_recurrence`; elementwise
operations, which no precision setting touches). The process's setting is neither read nor changed,
so nothing else in the process is affected and concurrent callers need no lock
(tests/test_precision.py emulates TF32 and bfloat16 on a CPU; scripts/check_precision_cuda.py
measures a GPU).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from verl_ext.turns import turn_index

#: Block length K of the blocked discounted scan. The in-block sums cost K multiply-adds per token
#: on CUDA, one elsewhere (and K − 1 small operations per block level); 16 measured fastest on one
#: CPU core with a float32 product, and as fast as 8 (faster than 32) with the recurrence.
SCAN_BLOCK = 16

#: Device types whose in-block sums are a float64 matrix product (one kernel); on every other
#: device (CPU, and devices without float64 such as MPS) they are the elementwise recurrence.
PRODUCT_DEVICES = ("cuda",)

#: Rows are processed in groups of about this many tokens (see the module docstring).
ROW_GROUP_TOKENS = 1 << 19


# --------------------------------------------------------------------------- on compacted rows


def discounted_sum(x: torch.Tensor, discount: float | torch.Tensor) -> torch.Tensor:
    """y_t = Σ_{k=t}^{T-1} d^{k-t} x_k   along the last axis.

    x: (B, T); discount d: a float or a (B,) tensor (one discount per row). Returns (B, T).

    Within each block of :data:`SCAN_BLOCK` positions the direct sums; across blocks the same
    scan, recursively, on the block heads with discount d^K. On the devices of
    :data:`PRODUCT_DEVICES` the in-block sums are one float64 matrix product, elsewhere a
    recurrence over the K positions (the module docstring says why not a float32 product).
    """
    if x.dim() != 2:
        raise ValueError(f"x must be (B, T), got shape {tuple(x.shape)}")
    d = _discount_tensor(discount, x.shape[0], x)
    if x.shape[1] == 0:
        return x.clone()
    scan = _scan_by_product if x.device.type in PRODUCT_DEVICES else _scan_by_recurrence
    return scan(x, d)


def _scan_by_product(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    batch, length = x.shape
    x, k, n_blocks = _whole_blocks(x)
    # (B, n_blocks, K) @ (K, K) or @ (B, K, K) with the triangular matrix of powers d^{j-i}, in
    # float64: the direct discounted sum inside each block, which no reduced-precision mode touches
    powers = _power_matrix(d.double(), k).transpose(-1, -2)
    local = torch.matmul(x.view(batch, n_blocks, k).double(), powers).to(x.dtype)
    if n_blocks > 1:
        # y at the first position of every block, then carried into the block before it
        starts = _scan_by_product(local[:, :, 0], d**k)
        next_start = torch.nn.functional.pad(starts[:, 1:], (0, 1))
        tail_decay = _tail_decay(d, k)  # d^(K-i): (K,) or (B, K)
        local += next_start.unsqueeze(-1) * (tail_decay.unsqueeze(1) if d.dim() else tail_decay)
    return local.view(batch, n_blocks * k)[:, :length]


def _scan_by_recurrence(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    batch, length = x.shape
    x, k, n_blocks = _whole_blocks(x)
    # a copy of the blocks (B, n_blocks, K): y_{K-1} = x_{K-1}, then y_i = x_i + d · y_{i+1}, one
    # strided elementwise operation per position
    y = x.reshape(batch, n_blocks, k).clone()
    per_row = d.view(-1, 1) if d.dim() else None
    for i in range(k - 2, -1, -1):
        if per_row is None:
            y[:, :, i].add_(y[:, :, i + 1], alpha=float(d))
        else:
            y[:, :, i].addcmul_(y[:, :, i + 1], per_row)
    if n_blocks > 1:
        starts = _scan_by_recurrence(y[:, :, 0], d**k)
        next_start = torch.nn.functional.pad(starts[:, 1:], (0, 1))
        tail_decay = _tail_decay(d, k)
        y += next_start.unsqueeze(-1) * (tail_decay.unsqueeze(1) if d.dim() else tail_decay)
    return y.view(batch, n_blocks * k)[:, :length]


def _whole_blocks(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """x zero-padded to whole blocks, the block length K and the number of blocks."""
    length = x.shape[1]
    k = min(SCAN_BLOCK, length)
    n_blocks = -(-length // k)
    if n_blocks * k != length:
        x = torch.nn.functional.pad(x, (0, n_blocks * k - length))
    return x, k, n_blocks


def _tail_decay(d: torch.Tensor, k: int) -> torch.Tensor:
    """d^(K-i) for i = 0 … K-1: (K,), or (B, K) for a (B,) d."""
    return d.unsqueeze(-1) ** torch.arange(k, 0, -1, dtype=d.dtype, device=d.device)


def shifted(x: torch.Tensor, n: int) -> torch.Tensor:
    """x_{t+n}, with 0 past the end: (B, T) -> (B, T). On compacted rows, the value n valid tokens later."""
    ahead = min(n, x.shape[1])
    return torch.nn.functional.pad(x[:, ahead:], (0, ahead))


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


# --------------------------------------------------------------------------- compaction and row groups


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
        mask = response_mask if response_mask.dtype == torch.int64 else (response_mask != 0).long()
        # 1-based rank of each valid token, 0 for masked ones (integer ops: a bool operand costs 2x)
        self.column = torch.cumsum(mask, dim=1).mul_(mask)
        self.width = -(-(response_mask.shape[1] + 1) // SCAN_BLOCK) * SCAN_BLOCK  # >= T+1, whole blocks

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T) -> (B, width) compacted buffer."""
        buffer = x.new_zeros(x.shape[0], self.width).scatter_(1, self.column, x)
        buffer[:, 0] = 0  # masked tokens' values (possibly inf/nan) must not reach the formula
        return buffer

    def scatter(self, buffer: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Compacted buffer -> (B, T) (into ``out`` if given); masked positions get unspecified values."""
        return torch.gather(buffer, 1, self.column, out=out)


def row_groups(batch: int, length: int) -> list[slice]:
    """Slices of rows, each about ROW_GROUP_TOKENS tokens (at least one row)."""
    rows = max(1, ROW_GROUP_TOKENS // max(1, length))
    return [slice(start, start + rows) for start in range(0, batch, rows)] or [slice(0, 0)]


def on_valid_tokens(
    formula: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    mask: torch.Tensor,
    *inputs: torch.Tensor,
    **per_row: float | torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """``formula(*compacted inputs, **per_row)`` on each row's valid tokens, scattered back to (B, T).

    ``inputs``: (B, T) tensors (None passes through as None); ``per_row``: floats, or (B,) tensors
    that are sliced to the rows of each group. ``formula`` returns one or more tensors in the
    compacted layout; each comes back as a (B, T) tensor of the inputs' dtype.
    """
    tensors = [x for x in inputs if x is not None]
    dtype = tensors[0].dtype
    batch = mask.shape[0]
    outputs: list[torch.Tensor] | None = None
    groups = row_groups(*mask.shape)
    for rows in groups:
        compaction = Compaction(mask[rows])
        compacted = [None if x is None else compaction.gather(x[rows]) for x in inputs]
        params = {k: v[rows] if isinstance(v, torch.Tensor) and v.dim() == 1 else v for k, v in per_row.items()}
        results = formula(*compacted, **params)
        results = results if isinstance(results, tuple) else (results,)
        if len(groups) == 1:
            return tuple(compaction.scatter(result.to(dtype)) for result in results)
        if outputs is None:
            outputs = [torch.empty(batch, mask.shape[1], dtype=dtype, device=mask.device) for _ in results]
        for out, result in zip(outputs, results):
            compaction.scatter(result.to(dtype), out=out[rows])
    return tuple(outputs)


# --------------------------------------------------------------------------- turns


class Turns:
    """The turns of compacted rows (the layout of :class:`Compaction`), and per-turn sums and values.

    Built from :func:`verl_ext.turns.turn_starts` compacted like any input. On the turn axis turn k of
    a row sits in column k + 1 of a zero buffer whose width is the batch's largest number of turns + 1:
    column 0 collects the parked column 0 of the compacted row (always 0), and the zeros after a row's
    last turn K are the terminal state (V_K = 0), as the zeros after L are on the token axis. Finding
    the width reads one number from the device (a synchronisation on a GPU).

    Per-turn sums are accumulated in float64: a long turn's rewards sum as exactly as a scan would.
    """

    def __init__(self, starts: torch.Tensor):
        self.first = starts != 0
        # column of each compacted token on the turn axis: turn k -> k + 1 (the parked column 0, before
        # any turn, -> 0); the zeros after L stay in the last turn's column, adding nothing to its sum
        self.column = turn_index(self.first).add_(1)
        self.width = (int(self.column[:, -1].max()) if self.column.numel() else 0) + 1

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """Σ of x over each turn's tokens: compacted (B, W) -> (B, width) float64."""
        out = torch.zeros(x.shape[0], self.width, dtype=torch.float64, device=x.device)
        return out.scatter_add_(1, self.column, x.double())

    def at_first_token(self, x: torch.Tensor) -> torch.Tensor:
        """x at each turn's first token: compacted (B, W) -> (B, width) float64."""
        # every other token writes to column 0, which is then cleared
        index = torch.where(self.first, self.column, 0)
        out = x.new_zeros(x.shape[0], self.width).scatter_(1, index, x)
        out[:, 0] = 0
        return out.double()

    def spread(self, y: torch.Tensor) -> torch.Tensor:
        """Each token gets its turn's entry: (B, width) -> compacted (B, W)."""
        return torch.gather(y, 1, self.column)


# --------------------------------------------------------------------------- whitening statistics


def masked_moments(x: torch.Tensor, mask: torch.Tensor) -> tuple[int, float, float]:
    """(n, Σx/n, Σ(x − mean)²) over the entries where ``mask`` is non-zero, any values elsewhere.

    Accumulated in float64 group by group (two passes over each cache-sized group, then Chan et
    al.'s merge), so that a batch of millions of float32 tokens has float32-exact statistics.
    """
    count, mean, m2 = 0, 0.0, 0.0
    dtype = torch.promote_types(x.dtype, torch.float32)  # squares of bfloat16 values need float32
    for rows in row_groups(*x.shape):
        weight = mask[rows].to(dtype)  # 0/1; a product is cheaper than torch.where
        n = int(weight.sum())
        if n == 0:
            continue
        values = x[rows].to(dtype)
        total = float((values * weight).sum(dtype=torch.float64))
        if not math.isfinite(total):  # inf or nan at masked positions (x·0 is nan there): mask them out
            values = torch.where(weight != 0, values, 0.0)
            total = float(values.sum(dtype=torch.float64))
        group_mean = total / n
        group_m2 = float((values - group_mean).mul_(weight).square_().sum(dtype=torch.float64))
        total = count + n
        delta = group_mean - mean
        m2 += group_m2 + delta * delta * count * n / total
        mean += delta * n / total
        count = total
    return count, mean, m2


def scaled(x: torch.Tensor, shift: float, scale: float) -> torch.Tensor:
    """(x − shift) · scale, group by group (B, T) -> (B, T)."""
    groups = row_groups(*x.shape)
    if len(groups) == 1:
        return (x - shift).mul_(scale)
    out = torch.empty_like(x)
    for rows in groups:
        torch.sub(x[rows], shift, out=out[rows]).mul_(scale)
    return out


#: The ε of verl's ``masked_whiten`` (verl.utils.torch_functional), in sqrt(σ² + ε). Its masked means
#: divide by mask.sum() + 1e-8 too, but verl's response mask is an integer tensor, and that sum plus
#: 1e-8 is a float32 number, n exactly (1e-8 is below half of float32's spacing at any n ≥ 1): μ is
#: Σx/n, σ² is Σ(x − μ)²/(n − 1) (docs/definitions.md#6-whitening-and-why-it-comes-after-the-returns).
WHITEN_EPS = 1e-8


def inverse_std(m2: float, count: int) -> float:
    """1 / sqrt(σ² + ε) with σ² the unbiased variance m2 / (n − 1), ε = WHITEN_EPS."""
    return 1.0 / math.sqrt(m2 / (count - 1) + WHITEN_EPS)

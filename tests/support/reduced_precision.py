"""Reduced-precision matrix products on a CPU, for tests: what TF32 (and bfloat16) do to float32.

With ``torch.set_float32_matmul_precision("high")`` a CUDA GPU multiplies float32 matrices on its
TF32 tensor cores: each operand is rounded to a 10-bit mantissa, products are accumulated in
float32. "medium" may use bfloat16 (a 7-bit mantissa), also on CPUs with bfloat16 units. A plain
CPU ignores both settings, so :class:`EmulatedReducedPrecision` does the rounding itself: while it
is active, every float32 operand of a matrix-family call is rounded to nearest (ties to even) to
the mantissa the *current* precision setting allows, then the real function runs. Elementwise
operations and reductions are left alone, as on the GPU. It reads the setting at each call and
never changes it.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

#: Mantissa bits kept per precision setting ("highest": all 23, no rounding).
MANTISSA_BITS = {"high": 10, "medium": 7}

#: Matrix-family functions whose float32 operands a reduced precision rounds, with the index of the
#: first operand that is a factor of a product (the ``add*`` family's first argument is an addend).
_FACTORS_FROM = {
    torch.matmul: 0,
    torch.Tensor.matmul: 0,
    torch.Tensor.__matmul__: 0,
    torch.Tensor.__rmatmul__: 0,
    torch.mm: 0,
    torch.Tensor.mm: 0,
    torch.bmm: 0,
    torch.Tensor.bmm: 0,
    torch.mv: 0,
    torch.Tensor.mv: 0,
    torch.einsum: 1,  # einsum(equation, *operands)
    torch.tensordot: 0,
    torch.inner: 0,
    torch.nn.functional.linear: 0,
    torch.linalg.matmul: 0,
    torch.linalg.multi_dot: 0,
    torch.linalg.vecdot: 0,
    torch.chain_matmul: 0,
    torch.addmm: 1,
    torch.Tensor.addmm: 1,
    torch.Tensor.addmm_: 1,
    torch.baddbmm: 1,
    torch.Tensor.baddbmm: 1,
    torch.Tensor.baddbmm_: 1,
    torch.addbmm: 1,
    torch.Tensor.addbmm: 1,
    torch.addmv: 1,
    torch.Tensor.addmv: 1,
}


def round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    """float32 ``x`` rounded to nearest, ties to even, to ``bits`` mantissa bits (finite values)."""
    drop = 23 - bits
    as_int = x.contiguous().view(torch.int32)
    lowest_kept = (as_int >> drop) & 1
    rounded = (as_int + ((1 << (drop - 1)) - 1) + lowest_kept) & -(1 << drop)
    return rounded.view(torch.float32).view(x.shape)


class EmulatedReducedPrecision(TorchFunctionMode):
    """While active, matrix-family calls see their float32 factors rounded as the current
    ``torch.get_float32_matmul_precision()`` allows on a GPU (module docstring). ``calls`` counts the
    rounded calls, so a test can tell that the emulation was exercised."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = _FACTORS_FROM.get(func)
        bits = MANTISSA_BITS.get(torch.get_float32_matmul_precision())
        if first is not None and bits is not None:
            rounded = [_rounded(a, bits) if i >= first else a for i, a in enumerate(args)]
            if any(r is not a for r, a in zip(rounded, args)):
                self.calls += 1
            args = tuple(rounded)
        return func(*args, **kwargs)


def _rounded(value, bits: int):
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return round_mantissa(value, bits)
    if isinstance(value, (list, tuple)):  # multi_dot, chain_matmul, einsum with a list
        return type(value)(_rounded(v, bits) for v in value)
    return value


def scan_by_float32_product(x, d):
    """The scan as it was before issue 18, for comparison: the in-block sums of
    ``verl_ext.kernels`` as one float32 matrix product, which reduced precision (TF32) rounds."""
    from verl_ext import kernels

    batch, length = x.shape
    x, k, n_blocks = kernels._whole_blocks(x)
    local = torch.matmul(x.view(batch, n_blocks, k), kernels._power_matrix(d, k).transpose(-1, -2))
    if n_blocks > 1:
        starts = scan_by_float32_product(local[:, :, 0], d**k)
        next_start = torch.nn.functional.pad(starts[:, 1:], (0, 1))
        tail_decay = kernels._tail_decay(d, k)
        local += next_start.unsqueeze(-1) * (tail_decay.unsqueeze(1) if d.dim() else tail_decay)
    return local.view(batch, n_blocks * k)[:, :length]

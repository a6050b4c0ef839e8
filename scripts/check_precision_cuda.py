"""The estimators on a CUDA GPU at every float32 matmul precision, against a float64 reference.

    .venv/bin/python scripts/check_precision_cuda.py            # needs a CUDA GPU and a CUDA build of torch
    .venv/bin/python scripts/check_precision_cuda.py --device cpu --sizes 64x1024   # a dry run

For B × T = 512 × 4096 and 128 × 16384 (mixed lengths 25-100 % of T, two interior holes per row, as
benchmarks/bench_estimators.py), on the GPU, under ``torch.set_float32_matmul_precision`` "highest",
"high" (TF32) and "medium": the largest error of each estimator's returns, raw advantage and
whitened advantage on valid tokens, as max |x − ref| / max |ref| (normwise) and as
max |x − ref| / (1 + |ref|) (tests/test_precision.py's measure, on longer rows here). The
reference is computed here in float64 by a plain loop over the compacted tokens (no verl-ext code).
The row "mc, float32 product" is the scan as it was before issue 18 (its in-block sums one float32
matrix product): under "high" it shows what TF32 does to it. Then the time per call under "high"
and verl's loop GAE for comparison. Checks that the process's precision setting is what it was
before every call. Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
from bench_estimators import make_batch  # noqa: E402

from tests.support.reduced_precision import scan_by_float32_product  # noqa: E402  (the scan before issue 18)

GAMMA, LAM, N_STEP = 0.99, 0.95, 8
CASES = {  # name: (registry name, options)
    "mc": ("mc", {}),
    "td0": ("td0", {}),
    "nstep n=8": ("nstep", {"n_step": N_STEP}),
    "gae_ext λ=0.95": ("gae_ext", {"lam": LAM}),
    "gae_ext λc=1 λa=0.95": ("gae_ext", {"lam_critic": 1.0, "lam_actor": LAM}),
}


def compacted(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's valid entries moved to the front, in order, zeros after them (float64)."""
    order = torch.argsort((mask == 0).to(torch.int8), dim=1, stable=True)
    lengths = mask.sum(1, keepdim=True)
    out = torch.gather(x.double(), 1, order)
    return out.masked_fill(torch.arange(x.shape[1], device=x.device)[None, :] >= lengths, 0.0), order


def discounted(x: torch.Tensor, d: float) -> torch.Tensor:
    """y_t = x_t + d y_{t+1}, a loop over T in float64."""
    y = torch.zeros_like(x)
    carry = torch.zeros_like(x[:, 0])
    for t in range(x.shape[1] - 1, -1, -1):
        carry = x[:, t] + d * carry
        y[:, t] = carry
    return y


def reference(rewards, values, mask):
    """{case: (returns, raw advantage)} in float64 at the original (B, T) positions."""
    r, order = compacted(rewards, mask)
    v, _ = compacted(values, mask)
    v_next = torch.nn.functional.pad(v[:, 1:], (0, 1))
    delta = r + GAMMA * v_next - v
    g = discounted(r, GAMMA)
    shift = lambda x, n: torch.nn.functional.pad(x[:, n:], (0, n))  # noqa: E731
    nstep = g - GAMMA**N_STEP * shift(g, N_STEP) + GAMMA**N_STEP * shift(v, N_STEP)
    gae, gae_critic = discounted(delta, GAMMA * LAM), discounted(delta, GAMMA)
    compact = {
        "mc": (g, g - v),
        "td0": (r + GAMMA * v_next, delta),
        "nstep n=8": (nstep, nstep - v),
        "gae_ext λ=0.95": (gae + v, gae),
        "gae_ext λc=1 λa=0.95": (gae_critic + v, gae),
    }

    def back(x):
        return torch.empty_like(x).scatter_(1, order, x)

    return {name: (back(a), back(b)) for name, (a, b) in compact.items()}


def whiten(x, mask):
    valid = x[mask != 0]
    return (x - valid.mean()) / torch.sqrt(valid.var() + 1e-8)


def errors(actual, expected, valid):
    a, e = actual.double()[valid], expected[valid]
    diff = (a - e).abs()
    return float(diff.max() / e.abs().max()), float((diff / (1 + e.abs())).max())


def run(name, rewards, values, mask, float32_product=False):
    from verl_ext import kernels, registry

    estimator_name, options = CASES[name]
    estimator = registry.get(estimator_name)
    settings = estimator.settings({"gamma": GAMMA, **options})
    saved = kernels._scan_by_product, kernels._scan_by_recurrence
    if float32_product:
        kernels._scan_by_product = kernels._scan_by_recurrence = scan_by_float32_product
    try:
        before = torch.get_float32_matmul_precision()
        result = registry.run(estimator, rewards, values, mask, settings)
        assert torch.get_float32_matmul_precision() == before, "the estimators changed the matmul precision"
        return result
    finally:
        kernels._scan_by_product, kernels._scan_by_recurrence = saved


def timed_ms(fn, device, repeats=7):
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", default="512x4096,128x16384")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA GPU here (use --device cpu for a dry run)")
    own = torch.get_float32_matmul_precision()
    name_of = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name_of}, torch {torch.__version__}, process precision {own!r}")
    for size in args.sizes.split(","):
        rows, length = (int(n) for n in size.split("x"))
        rewards, values, mask = (t.to(device) for t in make_batch(rows, length))
        valid = mask != 0
        expected = reference(rewards, values, mask)
        print(f"\nB x T = {rows} x {length}: normwise max|x - ref| / max|ref|  (max |x - ref| / (1 + |ref|))")
        print(f"{'':32s} {'precision':>9s} {'returns':>22s} {'advantage_raw':>22s} {'advantages':>22s}")
        for precision in ("highest", "high", "medium"):
            torch.set_float32_matmul_precision(precision)
            rows_out = [(name, False) for name in CASES] + [("mc", True), ("gae_ext λ=0.95", True)]
            for name, old in rows_out:
                result = run(name, rewards, values, mask, float32_product=old)
                ret, raw = expected[name]
                cells = [errors(result.returns, ret, valid), errors(result.advantage_raw, raw, valid)]
                cells.append(errors(result.advantages, whiten(raw, mask), valid))
                label = name + (", float32 product" if old else "")
                print(f"{label:32s} {precision:>9s} " + " ".join(f"{a:9.1e} ({b:8.1e})" for a, b in cells), flush=True)
        torch.set_float32_matmul_precision("high")
        try:
            from verl.trainer.ppo.core_algos import compute_gae_advantage_return
        except ImportError:  # verl-ext's estimators need only torch
            loop = None
        else:
            loop = timed_ms(lambda: compute_gae_advantage_return(rewards, values, mask, GAMMA, LAM), device, repeats=3)
        print("time under 'high': " + ("verl not importable" if loop is None else f"verl's loop GAE {loop:.1f} ms"), end="")
        for name in CASES:
            ms = timed_ms(lambda: run(name, rewards, values, mask), device)
            print(f"; {name} {ms:.2f} ms" + ("" if loop is None else f" ({loop / ms:.0f}x)"), end="")
        print(flush=True)
        torch.set_float32_matmul_precision(own)
    print(f"\nprocess precision at the end: {torch.get_float32_matmul_precision()!r}")


if __name__ == "__main__":
    main()

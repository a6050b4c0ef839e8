"""Speed and memory of the estimators against verl's loop GAE, on one CPU thread.

    .venv/bin/python benchmarks/bench_estimators.py [--repeats 5]

Batches have mixed lengths (25-100 % of T valid) and two interior holes of 8-32 tokens per
row, like multi-turn rollouts, so the general (compaction) path is what is measured. Baselines
run in the same process: verl's ``compute_gae_advantage_return`` (a Python loop over T, with
returns and whitening) and one ``torch.cumsum`` over a tensor of the same size (a memory-bound
floor). Extra peak memory is the growth of the peak RSS of a fresh process running the
estimator once, relative to the bytes of its inputs (rewards, values and mask): Linux's peak
RSS (VmHWM) is reset after the inputs exist (``/proc/self/clear_refs``), so the growth is what
the estimator allocates, outputs included.

Prints figures and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

SIZES = [(512, 4096), (128, 16384)]


def make_batch(rows: int, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    for _ in range(2):
        start = torch.randint(1, length // 4, (rows,), generator=g)
        width = torch.randint(8, 33, (rows,), generator=g)
        cols = torch.arange(length)[None, :]
        mask[(cols >= start[:, None]) & (cols < (start + width)[:, None])] = 0
    rewards = torch.randn(rows, length, generator=g) * mask
    values = torch.randn(rows, length, generator=g)
    return rewards, values, mask


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def candidates(rewards, values, mask):
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    from verl_ext import estimators as E
    from verl_ext.options import EstimatorOptions

    def full(name, **kw):
        options = EstimatorOptions(name=name, gamma=0.99, lam=0.95, n_step=8, **kw)
        return lambda: E.estimate(rewards, values, mask, options)

    return {
        "torch.cumsum (floor)": lambda: torch.cumsum(rewards, dim=1),
        "verl loop GAE (+returns, whiten)": lambda: compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95),
        "gae_ext (+returns, whiten)": full("gae_ext"),
        "gae_ext core (+returns, no whiten)": full("gae_ext", whiten_advantages=False),
        "mc (+whiten)": full("mc"),
        "td0 (+whiten)": full("td0"),
        "nstep n=8 (+whiten)": full("nstep"),
        "masked_whiten alone": lambda: E.masked_whiten(values, mask),
    }


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def peak_memory_child(rows: int, length: int, name: str) -> None:
    rewards, values, mask = make_batch(rows, length)
    fns = candidates(rewards, values, mask)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak RSS to the current RSS
    before = peak_rss_bytes()
    fns[name]()
    print(peak_rss_bytes() - before)


def extra_peak_bytes(rows: int, length: int, name: str) -> int:
    out = subprocess.run(
        [sys.executable, __file__, "--peak-child", str(rows), str(length), name],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peak-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.peak_child:
        rows, length, name = args.peak_child
        return peak_memory_child(int(rows), int(length), name)

    for rows, length in SIZES:
        rewards, values, mask = make_batch(rows, length)
        input_bytes = sum(t.numel() * t.element_size() for t in (rewards, values, mask))
        valid = int(mask.sum())
        print(f"\nB x T = {rows} x {length}  ({valid / mask.numel():.0%} valid, inputs {input_bytes / 2**20:.0f} MiB), 1 thread")
        fns = candidates(rewards, values, mask)
        times = {
            name: timed(fn, 2 if name.startswith("verl") else args.repeats) for name, fn in fns.items()
        }
        floor, verl = times["torch.cumsum (floor)"], times["verl loop GAE (+returns, whiten)"]
        print(f"{'':36s} {'median ms':>10s} {'x cumsum':>9s} {'verl / this':>12s} {'extra peak / inputs':>20s}")
        for name, seconds in times.items():
            extra = extra_peak_bytes(rows, length, name) / input_bytes
            print(f"{name:36s} {seconds * 1e3:10.1f} {seconds / floor:9.1f} {verl / seconds:12.1f} {extra:20.2f}")


if __name__ == "__main__":
    main()

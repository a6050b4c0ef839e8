"""Speed and memory of the estimators against verl's loop GAE, on one CPU thread.

    .venv/bin/python benchmarks/bench_estimators.py [--repeats 7]

Batches have mixed lengths (25-100 % of T valid) and two interior holes of 8-32 tokens per
row, like multi-turn rollouts, so the general (compaction) path is what is measured. Baselines
run in the same process: verl's ``compute_gae_advantage_return`` (a Python loop over T, with
returns and whitening) and one ``torch.cumsum`` over a tensor of the same size (a memory-bound
floor).

Each table is printed twice, from two fresh processes: with glibc's default allocator settings,
and with ``MALLOC_TOP_PAD_`` = 256 MiB, which keeps freed memory in the heap instead of returning it
to the OS. On this VM a page fault costs ~1.7 µs, so a function that returns three fresh 8 MiB
tensors pays ~10 ms of faults whenever glibc has given the previous call's memory back; the
second table is the steady state of a long-running process (or of jemalloc/tcmalloc). The
"faults" column is minor page faults per call.

Extra peak memory is the growth of the peak RSS (VmHWM, reset with ``/proc/self/clear_refs``
after the inputs exist) of a fresh process running the function once, over the bytes of its
inputs (rewards, values and mask); outputs are included.

A last table compares the turn-level ``turn_gae`` with ``gae_ext`` at B × T = 512 × 4096 on
responses of exactly four turns (three interior holes of 8-32 tokens, then padding), in the warm
table's process; ``--turns-only`` prints just that table.

Prints figures and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

SIZES = [(512, 4096), (128, 16384)]
WARM_ALLOCATOR = {"MALLOC_TOP_PAD_": str(256 << 20)}


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


def make_turn_batch(rows: int, length: int, turns: int = 4, seed: int = 0):
    """Rows of exactly ``turns`` turns: ``turns`` − 1 holes of 8-32 tokens spread over the first half
    of the valid part (25-100 % of T), so every turn has tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (rows,), generator=g)
    cols = torch.arange(length)[None, :]
    mask = (cols < lengths[:, None]).long()
    for k in range(1, turns):
        start = lengths * k // (2 * turns)
        width = torch.randint(8, 33, (rows,), generator=g)
        mask[(cols >= start[:, None]) & (cols < (start + width)[:, None])] = 0
    rewards = torch.randn(rows, length, generator=g) * mask
    values = torch.randn(rows, length, generator=g)
    return rewards, values, mask


def turn_candidates(rewards, values, mask):
    from verl_ext import registry

    def full(name, **kw):
        estimator = registry.get(name)
        settings = estimator.settings({"gamma": 0.99, "lam": 0.95, **kw})
        return lambda: registry.run(estimator, rewards, values, mask, settings)

    return {
        "gae_ext (+returns, whiten)": full("gae_ext"),
        "turn_gae (+returns, whiten)": full("turn_gae"),
        "gae_ext (+returns, no whiten)": full("gae_ext", whiten_advantages=False),
        "turn_gae (+returns, no whiten)": full("turn_gae", whiten_advantages=False),
    }


def print_turn_times(repeats: int) -> None:
    rows, length, turns = 512, 4096, 4
    rewards, values, mask = make_turn_batch(rows, length, turns)
    starts = (mask[:, 1:] > mask[:, :-1]).sum(1) + mask[:, 0]
    assert bool((starts == turns).all())  # the batch is what the table says (not a timing assertion)
    print(f"\nturn_gae against gae_ext: B x T = {rows} x {length}, {turns} turns a response, {mask.float().mean():.0%} valid")
    results = {name: timed(fn, repeats) for name, fn in turn_candidates(rewards, values, mask).items()}
    print(f"{'':34s} {'median ms':>9s} {'faults':>7s} {'this / gae_ext':>14s}")
    for name, (seconds, faults) in results.items():
        baseline = results[name.replace("turn_gae", "gae_ext")][0]
        print(f"{name:34s} {seconds * 1e3:9.1f} {faults:7.0f} {seconds / baseline:14.2f}", flush=True)


def candidates(rewards, values, mask):
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    from verl_ext import estimators as E
    from verl_ext import registry

    def full(name, **kw):
        """What the seam runs for algorithm.adv_estimator=name: the registered estimator, then whitening."""
        estimator = registry.get(name)
        settings = estimator.settings({"gamma": 0.99, "lam": 0.95, "n_step": 8 if name == "nstep" else None, **kw})
        return lambda: registry.run(estimator, rewards, values, mask, settings)

    return {
        "torch.cumsum (floor)": lambda: torch.cumsum(rewards, dim=1),
        "verl loop GAE (+returns, whiten)": lambda: compute_gae_advantage_return(rewards, values, mask, 0.99, 0.95),
        "gae_ext (+returns, whiten)": full("gae_ext"),
        "gae_ext (+returns, no whiten)": full("gae_ext", whiten_advantages=False),
        "mc (+whiten)": full("mc"),
        "td0 (+whiten)": full("td0"),
        "nstep n=8 (+whiten)": full("nstep"),
        "masked_whiten alone": lambda: E.masked_whiten(values, mask),
    }


def timed(fn, repeats: int) -> tuple[float, float]:
    """(median seconds, minor page faults per call)."""
    fn()
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / repeats


def print_times(repeats: int, with_memory: bool) -> None:
    for rows, length in SIZES:
        rewards, values, mask = make_batch(rows, length)
        input_bytes = sum(t.numel() * t.element_size() for t in (rewards, values, mask))
        valid = int(mask.sum())
        print(f"\nB x T = {rows} x {length} ({valid / mask.numel():.0%} valid, inputs {input_bytes >> 20} MiB)")
        fns = candidates(rewards, values, mask)
        results = {name: timed(fn, 2 if name.startswith("verl") else repeats) for name, fn in fns.items()}
        floor, verl = results["torch.cumsum (floor)"][0], results["verl loop GAE (+returns, whiten)"][0]
        header = f"{'':34s} {'median ms':>9s} {'faults':>7s} {'x cumsum':>8s} {'verl / this':>11s}"
        print(header + (f" {'extra peak / inputs':>19s}" if with_memory else ""))
        for name, (seconds, faults) in results.items():
            line = f"{name:34s} {seconds * 1e3:9.1f} {faults:7.0f} {seconds / floor:8.1f} {verl / seconds:11.1f}"
            if with_memory:
                line += f" {extra_peak_bytes(rows, length, name) / input_bytes:19.2f}"
            print(line, flush=True)


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
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--peak-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--table", choices=["default", "warm"], help=argparse.SUPPRESS)
    parser.add_argument("--turns-only", action="store_true", help="only the turn_gae table (warm allocator)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.peak_child:
        rows, length, name = args.peak_child
        return peak_memory_child(int(rows), int(length), name)
    if args.table:
        if not args.turns_only:
            print_times(args.repeats, with_memory=args.table == "default")
        if args.table == "warm":
            print_turn_times(args.repeats)
        return
    tables = (
        ("default", {}, "glibc defaults (one thread)"),
        ("warm", WARM_ALLOCATOR, "MALLOC_TOP_PAD_=256MiB: freed memory stays in the heap (one thread)"),
    )
    for table, env, title in tables[1:] if args.turns_only else tables:
        print(f"\n=== {title}", flush=True)
        subprocess.run(
            [sys.executable, __file__, "--table", table, "--repeats", str(args.repeats), *(["--turns-only"] if args.turns_only else [])],
            env={**os.environ, **env}, check=True,
        )  # fmt: skip


if __name__ == "__main__":
    main()

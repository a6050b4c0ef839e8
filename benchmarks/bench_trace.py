"""Cost of the per-token trace at B × T = 512 × 4096 with about half the tokens valid.

Prints (asserts nothing):

* the synchronous time ``TraceWriter.submit`` adds to a trainer step (writer idle, as it is when a
  trainer step takes longer than a write);
* the background write throughput (valid-or-not rows written per second, one step at a time, and
  with steps submitted back to back);
* bytes per token on disk;
* peak RSS growth while steps are submitted back to back, for several queue sizes.

Timings are min / median over ``--repeats`` runs. Writer and trainer side run in one process, on
the local filesystem unless ``--dir`` names another place (any fsspec URL); each RSS figure comes
from a fresh interpreter (this script, re-run with a hidden ``--rss`` option).

    python benchmarks/bench_trace.py [--batch 512] [--length 4096] [--repeats 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import fsspec
import numpy as np
import torch

from verl_ext import registry
from verl_ext.options import TraceOptions
from verl_ext.trace.capture import StepCapture
from verl_ext.trace.schema import FLOAT_COLUMN_NAMES, RunRecord
from verl_ext.turns import turn_ends
from verl_ext.trace.reader import open_trace
from verl_ext.trace.writer import TraceWriter


BENCH_RECORD = RunRecord(
    verl_ext_version="bench", verl_version="", trainer="legacy", created_at="", algorithm={}, model_path=None,
    tokenizer_path=None, rollout_n=None, trace={},
)


def synthetic_capture(batch: int, length: int, dtype: torch.dtype, seed: int = 0) -> StepCapture:
    """Mixed response lengths (uniform in 1 … T, one full-length sample), about 3% interior
    masked positions, a sparse outcome score, log-probs near each other, KL in the reward."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=generator)
    lengths[0] = length
    positions = torch.arange(length)
    mask = positions[None, :] < lengths[:, None]
    mask &= torch.rand(batch, length, generator=generator) > 0.03
    mask[torch.arange(batch), lengths - 1] = True

    def noise() -> torch.Tensor:
        return torch.randn(batch, length, generator=generator)

    scores = torch.zeros(batch, length)
    scores[torch.arange(batch), lengths - 1] = (torch.rand(batch, generator=generator) > 0.5).float()
    old_log_probs = -3 * torch.rand(batch, length, generator=generator)
    ref_log_prob = old_log_probs + 0.01 * noise()
    kl = old_log_probs - ref_log_prob
    tool_reward = 0.1 * turn_ends(mask).float()  # a per-turn reward on every turn's last token (the mask's holes make turns)
    rewards = scores + tool_reward - 0.001 * kl
    values = noise()
    returns = noise()
    advantage_raw = returns - values
    prompt_length = 1024
    prompt_mask = torch.arange(prompt_length)[None, :] >= torch.randint(0, prompt_length, (batch, 1), generator=generator)
    group = 8
    uid = np.array([str(uuid.uuid4()) for _ in range(batch // group) for _ in range(group)], dtype=object)
    tensors = {
        "score": scores,
        "reward": rewards,
        "value": values,
        "return": returns,
        "advantage": (advantage_raw - advantage_raw[mask].mean()) / advantage_raw[mask].std(),
        "advantage_raw": advantage_raw,
        "old_log_prob": old_log_probs,
        "ref_log_prob": ref_log_prob,
        "kl": kl,
        "rollout_log_prob": old_log_probs + 0.001 * noise(),
        "rollout_is_weight": torch.exp(0.001 * noise()).clamp(max=2.0),
        "turn_score": torch.zeros(batch, length),
        "tool_reward": tool_reward,
    }
    assert set(tensors) == set(FLOAT_COLUMN_NAMES)
    return StepCapture(
        step=0,
        mask=mask.long(),
        token_id=torch.randint(0, 150_000, (batch, length), generator=generator),
        uid=uid,
        floats={name: tensor.to(dtype) for name, tensor in tensors.items()},
        prompts=torch.randint(0, 150_000, (batch, prompt_length), generator=generator) * prompt_mask,
        prompt_mask=prompt_mask.long(),
        kl_coef=0.001,
        whitening=registry.whitening_statistics(tensors["advantage_raw"], mask),
    )


def with_step(capture: StepCapture, step: int) -> StepCapture:
    return StepCapture(**{**capture.__dict__, "step": step})


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Samples this process's RSS every millisecond on a thread; ``peak`` is the maximum seen."""

    def __init__(self):
        self.peak = rss_bytes()
        self._running = True
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while self._running:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._running = False
        self._thread.join()


def summary(values: list[float], unit: str, scale: float = 1.0) -> str:
    return f"min {min(values) * scale:.1f} {unit}, median {statistics.median(values) * scale:.1f} {unit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--dir", help="trace directory or fsspec URL (default: a fresh temporary directory)")
    parser.add_argument("--rss", type=int, metavar="QUEUE_SIZE", help=argparse.SUPPRESS)  # one RSS measurement
    args = parser.parse_args()

    capture = synthetic_capture(args.batch, args.length, getattr(torch, args.dtype))
    if args.rss:
        measure_rss(args.rss, capture)
        return
    rows = int(sum(int(row.nonzero().max()) + 1 for row in capture.mask if row.any()))
    valid = int(capture.mask.sum())
    print(f"B x T = {args.batch} x {args.length}, {args.dtype}; valid tokens {valid} ({valid / capture.mask.numel():.0%}), "
          f"rows per step {rows} (positions up to each sample's last valid token); torch threads {torch.get_num_threads()}")

    with tempfile.TemporaryDirectory(prefix="bench-trace-") as scratch:
        directory = args.dir or os.path.join(scratch, "trace")
        with TraceWriter(TraceOptions(dir=directory, queue_size=2), BENCH_RECORD) as writer:
            writer.submit(with_step(capture, 0))  # warm-up: imports, allocator, file system
            writer.flush()
            submit_s, write_s = [], []
            for step in range(1, args.repeats + 1):
                start = time.perf_counter()
                writer.submit(with_step(capture, step))
                submitted = time.perf_counter()
                writer.flush()
                submit_s.append(submitted - start)
                write_s.append(time.perf_counter() - submitted)
            print(f"synchronous submit time: {summary(submit_s, 'ms', 1e3)}")
            print(f"background write, one step at a time: {summary(write_s, 's')} per step; "
                  f"throughput max {rows / min(write_s) / 1e6:.2f}, median {rows / statistics.median(write_s) / 1e6:.2f} M tokens/s")

            back_to_back = 2 * args.repeats
            start = time.perf_counter()
            for step in range(args.repeats + 1, args.repeats + 1 + back_to_back):
                writer.submit(with_step(capture, step))
            writer.flush()
            elapsed = time.perf_counter() - start
            print(f"back to back, {back_to_back} steps (submit included): {rows * back_to_back / elapsed / 1e6:.2f} M tokens/s")

        entry = open_trace(directory).step_record(1)
        fs, root = fsspec.core.url_to_fs(directory)
        token_size = fs.size(f"{root}/{entry.file}")
        size = token_size + fs.size(f"{root}/{entry.prompts_file}")
        print(f"on disk: {token_size / rows:.2f} bytes per token row (token file), {size / rows:.2f} with the prompt file; "
              f"{token_size / 2**20:.1f} MiB per step")

    block_mib = (capture.mask.numel() * (len(FLOAT_COLUMN_NAMES) * 4 + 4 + 1) + capture.prompts.numel() * (4 + 1)) / 2**20
    print(f"one snapshot block: {block_mib:.0f} MiB (B x ({len(FLOAT_COLUMN_NAMES) * 4 + 5} T + 5 P) bytes); a writer keeps up to queue_size + 2 "
          "blocks, plus one step's Arrow tables and Parquet buffers while writing it")
    for queue_size in (1, 2, 4):
        # A fresh interpreter per queue size: allocators (glibc, mimalloc) keep memory freed by an
        # earlier measurement and would hide the growth of a later one.
        command = [sys.executable, __file__, "--rss", str(queue_size), "--batch", str(args.batch),
                   "--length", str(args.length), "--dtype", args.dtype]
        print(subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip())


def measure_rss(queue_size: int, capture: StepCapture) -> None:
    steps = queue_size + 3
    with tempfile.TemporaryDirectory(prefix="bench-trace-rss-") as scratch:
        baseline = rss_bytes()
        with TraceWriter(TraceOptions(dir=scratch, queue_size=queue_size), BENCH_RECORD) as writer, PeakRss() as rss:
            for step in range(steps):
                writer.submit(with_step(capture, step))
            writer.flush()
    print(f"queue_size {queue_size}: peak RSS growth {(rss.peak - baseline) / 2**20:.0f} MiB "
          f"while {steps} steps were submitted back to back")


if __name__ == "__main__":
    main()

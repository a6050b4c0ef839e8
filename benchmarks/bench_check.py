"""Throughput of ``verl-ext check`` on a synthetic trace (default 10 M valid tokens), in 1, 2, … processes
and as Ray tasks.

    python benchmarks/bench_check.py                       # build a trace in a temp dir, check it
    python benchmarks/bench_check.py --dir /tmp/bench10m   # keep the trace there (reused next time)
    python benchmarks/bench_check.py --jobs 1,2 --ray 2    # 1 and 2 processes, then 2 Ray workers

One line per setting: the end-to-end time of checking every step, workers' start included (each
imports torch: about 2.5 s), as a command's would be; then ``jobs=N tokens_per_s=X`` (``ray jobs=N …``
for Ray, on a cluster of N CPUs the script starts here), the rate once the workers run: the tokens of
the steps that finish after the N-th one (by then each worker has finished its first), over the time
from the N-th to the last.

The trace is written with the real TraceWriter from batches shaped like a GAE run with KL in the
reward: 1024 responses per step of 500 to 1500 tokens, interior masked spans, whitened advantages
computed by verl-ext's own estimators in float32. Reports valid tokens per second of
``check_trace`` (reading included, first step to last) and the process's peak memory, which stays
bounded by one step because the checker reads and checks one step at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch

from verl_ext import registry
from verl_ext.check.run import check_trace
from verl_ext.inspect.render import ProgressPrinter
from verl_ext.options import TraceOptions
from verl_ext.trace.capture import StepCapture
from verl_ext.trace.reader import open_trace
from verl_ext.trace import parallel
from verl_ext.trace.schema import RunRecord
from verl_ext.trace.writer import TraceWriter

ESTIMATOR = registry.get("gae_ext")
SETTINGS = ESTIMATOR.settings({"gamma": 1.0, "lam": 0.95})
KL_COEF = 0.01


def synthetic_step(step: int, samples: int, min_len: int, max_len: int) -> StepCapture:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(min_len, max_len + 1, (samples,), generator=g)
    width = int(lengths.max())
    positions = torch.arange(width)
    mask = (positions < lengths[:, None]).float()
    mask[::4, 100:140] = 0  # a tool-output span inside every fourth response
    scores = torch.zeros(samples, width)
    scores[torch.arange(samples), lengths - 1] = torch.randint(0, 2, (samples,), generator=g).float()
    kl = torch.rand(samples, width, generator=g).mul_(0.1) * mask
    rewards = scores - KL_COEF * kl
    values = torch.rand(samples, width, generator=g).to(torch.bfloat16).float() * mask
    result = registry.run(ESTIMATOR, rewards, values, mask, SETTINGS)
    floats = {"score": scores, "reward": rewards, "value": values, "advantage": result.advantages}
    floats |= {"return": result.returns, "advantage_raw": result.advantage_raw, "kl": kl}
    return StepCapture(
        step=step, mask=mask, token_id=torch.randint(0, 32000, (samples, width), generator=g), uid=None,
        floats=floats, kl_coef=KL_COEF, whitening=registry.whitening_statistics(result.advantage_raw, mask),
    )  # fmt: skip


def build_trace(directory: Path, tokens: int, steps: int, samples: int) -> None:
    per_sample = tokens / steps / samples
    min_len, max_len = int(per_sample * 0.5) + 1, int(per_sample * 1.5)
    record = RunRecord(
        verl_ext_version="bench", verl_version="0.9.1", trainer="legacy", created_at="",
        algorithm={
            "adv_estimator": "gae_ext", **{key: SETTINGS[key] for key in ("gamma", "lam", "lam_critic", "lam_actor")},
            "lam_length_alpha": None, "whiten_advantages": True, "norm_adv_by_std_in_grpo": True,
            "use_kl_in_reward": True, "kl_penalty": "kl", "kl_ctrl": {"type": "fixed", "kl_coef": KL_COEF},
        },
        model_path="", tokenizer_path="", rollout_n=1, trace={},
    )  # fmt: skip
    options = TraceOptions(dir=str(directory))
    with TraceWriter(options, dataclasses.replace(record, trace=options.as_dict())) as writer:
        for step in range(1, steps + 1):
            writer.submit(synthetic_step(step, samples, min_len, max_len))
            print(f"built step {step}/{steps}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=10e6, help="approximate valid tokens in the trace")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--samples", type=int, default=1024, help="responses per step")
    parser.add_argument("--dir", type=Path, help="where to keep the trace (reused when it exists)")
    parser.add_argument("--repeat", type=int, default=3, help="check this many times, report the best")
    parser.add_argument("--jobs", default="1", help="comma-separated process counts to measure (default: 1)")
    parser.add_argument("--ray", type=int, metavar="N", help="also as Ray tasks on a cluster of N CPUs started here")
    args = parser.parse_args()
    parallel.MIN_PARALLEL_ROWS = 0  # measure the workers whatever the trace's size

    directory = args.dir or Path(tempfile.mkdtemp(prefix="bench_check_")) / "trace"
    if not (directory / "_run.json").exists():
        started = time.perf_counter()
        build_trace(directory, int(args.tokens), args.steps, args.samples)
        print(f"trace written to {directory} in {time.perf_counter() - started:.1f} s")
    try:
        settings = [(f"jobs={jobs}", jobs, {"jobs": jobs}) for jobs in map(int, args.jobs.split(","))]
        if args.ray:
            import ray

            ray.init(num_cpus=args.ray, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
            settings.append((f"ray jobs={args.ray}", args.ray, {"ray_address": "auto"}))
        for label, workers, how in settings:
            best, steady = None, 0.0
            for _ in range(args.repeat):
                trace = open_trace(str(directory))
                printer, seen = ProgressPrinter("check"), []

                def progress(done: int, total: int, tokens: int) -> None:
                    seen.append((time.perf_counter(), tokens))
                    printer(done, total, tokens)

                started = time.perf_counter()
                report = check_trace(trace, progress=progress, **how)
                elapsed = time.perf_counter() - started
                assert report.passed, [str(r.first) for r in report.identities if r.first]
                best = elapsed if best is None else min(best, elapsed)
                # once running: the tokens of the steps that finished after each worker's first one, over
                # the time they took (from the first finished step on, the others' first steps would count
                # work done before it)
                (first_at, first_tokens), (last_at, last_tokens) = seen[min(workers, len(seen)) - 1], seen[-1]
                steady = max(steady, (last_tokens - first_tokens) / max(last_at - first_at, 1e-9))
            peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(
                f"check: {report.tokens:,} valid tokens in {len(report.steps)} steps, best of {args.repeat}: "
                f"{best:.2f} s = {report.tokens / best / 1e6:.1f} M tokens/s end to end (workers' start included); "
                f"peak RSS of this process {peak_mib:.0f} MiB; once each worker has finished a step: {label} tokens_per_s={steady:.0f}",
                flush=True,
            )
    finally:
        if args.dir is None:
            shutil.rmtree(directory.parent, ignore_errors=True)


if __name__ == "__main__":
    main()

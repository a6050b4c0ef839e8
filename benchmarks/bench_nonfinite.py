"""What the non-finite check (verl_ext.nonfinite) costs on a finite step, at B × T = 512 × 4096.

    .venv/bin/python benchmarks/bench_nonfinite.py [--repeats 15]

verl's own ``compute_advantage`` (the plugin's seam, as both trainers call it) on a batch as verl
has it at that point: scores = rewards, values, old, reference and rollout log-probs, mixed lengths
and two interior holes per row, in float32 on the CPU (where verl computes advantages, in the
driver). Each estimator runs with the check on (``verl_ext.nonfinite=warn``, a finite step) and
off (``=off``, the baseline), interleaved in this process, one thread; the ratio is on / off of the
medians, of wall time and of this thread's CPU time (which a busy machine disturbs less: time spent
descheduled is not counted). Then the check alone on the finite step, and on a step with one NaN
value (the per-token search that names it). Prints figures and ratios; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_estimators import make_batch  # noqa: E402

ROWS, LENGTH = 512, 4096


def step_batch():
    from verl import DataProto

    rewards, values, mask = make_batch(ROWS, LENGTH)
    g = torch.Generator().manual_seed(1)
    tensors = {
        "response_mask": mask,
        "token_level_scores": rewards,
        "token_level_rewards": rewards,  # verl stores the scores as the rewards when the KL is not in the reward
        "values": values,
        **{name: -torch.rand(ROWS, LENGTH, generator=g) for name in ("old_log_probs", "ref_log_prob", "rollout_log_probs")},
    }
    uid = np.array([f"u{i // 4}" for i in range(ROWS)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid})


def mode(value: str):
    from verl_ext.integration import step

    config = {"verl_ext": {"nonfinite": value, "metrics": False}}  # the check alone
    return step.fit_session(SimpleNamespace(config=config, global_steps=1), "legacy")


def median_ms(fn, repeats: int, context=contextlib.nullcontext, clock=time.perf_counter) -> float:
    times = []
    for _ in range(repeats):
        with context():
            start = clock()
            fn()
            times.append(clock() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from omegaconf import OmegaConf
    from verl.trainer.ppo import ray_trainer

    from verl_ext import nonfinite
    from verl_ext.integration.nonfinite_hook import QUANTITIES

    data = step_batch()
    valid = int(data.batch["response_mask"].sum())
    print(f"B x T = {ROWS} x {LENGTH}, {valid / (ROWS * LENGTH):.0%} valid, one thread, torch {torch.__version__}")
    print(f"{'compute_advantage':28s} {'wall: off ms':>12s} {'on ms':>8s} {'on / off':>9s}   {'cpu: off ms':>11s} {'on ms':>8s} {'on / off':>9s}")
    for estimator, extra, repeats in (("mc", {}, args.repeats), ("gae_ext", {}, args.repeats), ("grpo", {}, args.repeats), ("gae", {}, 3)):
        algorithm = OmegaConf.create({"adv_estimator": estimator, "gamma": 0.99, "lam": 0.95, **extra})

        def step():
            ray_trainer.compute_advantage(data, adv_estimator=estimator, gamma=0.99, lam=0.95, num_repeat=4, config=algorithm)

        with mode("off"):
            step()  # warm-up
        times = {(clock, check): [] for clock in ("wall", "cpu") for check in ("off", "warn")}
        for _ in range(repeats):  # interleaved: the same machine state for both
            for check in ("off", "warn"):
                for clock, read in (("wall", time.perf_counter), ("cpu", time.thread_time)):
                    times[clock, check].append(median_ms(step, 1, lambda: mode(check), read))
        m = {key: statistics.median(values) for key, values in times.items()}
        label = estimator + (" (verl's loop)" if estimator == "gae" else "")
        print(
            f"{label:28s} {m['wall', 'off']:12.1f} {m['wall', 'warn']:8.1f} {m['wall', 'warn'] / m['wall', 'off']:9.3f}   "
            f"{m['cpu', 'off']:11.1f} {m['cpu', 'warn']:8.1f} {m['cpu', 'warn'] / m['cpu', 'off']:9.3f}",
            flush=True,
        )

    quantities = {name: data.batch[name] for name in QUANTITIES if name in data.batch.keys()}
    mask = data.batch["response_mask"]
    checked = len({t.data_ptr() for n, t in quantities.items() if n not in nonfinite.CAUSE_ONLY})
    finite_ms = median_ms(lambda: nonfinite.find(quantities, mask), args.repeats)
    finite_cpu = median_ms(lambda: nonfinite.find(quantities, mask), args.repeats, clock=time.thread_time)
    mib = checked * ROWS * LENGTH * 4 >> 20
    print(f"\nthe check alone, finite step ({checked} distinct tensors, {mib} MiB read): {finite_ms:.2f} ms ({finite_cpu:.2f} ms cpu)")
    broken = dict(quantities, values=quantities["values"].clone())
    broken["values"][3, int(mask[3].nonzero()[5])] = float("nan")
    broken["advantages"] = torch.full_like(broken["values"], float("nan"))
    broken_ms = median_ms(lambda: nonfinite.find(broken, mask), max(3, args.repeats // 3))
    print(f"the check with one NaN value (the per-token search and the line): {broken_ms:.2f} ms")
    print(nonfinite.find(broken, mask).line(step=1, uid=data.non_tensor_batch["uid"]))


if __name__ == "__main__":
    main()

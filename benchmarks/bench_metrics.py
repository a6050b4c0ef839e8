"""What the live metrics (verl_ext.metrics, docs/definitions.md §9) cost, at B × T = 512 × 4096.

    .venv/bin/python benchmarks/bench_metrics.py [--repeats 15] [--demo-metrics RUN/metrics.jsonl]

verl's ``compute_advantage`` (the plugin's seam, where both trainers compute the step's metrics) on
a batch as verl has it there (bench_nonfinite.py's: mixed lengths, two interior holes per row, float32
on the CPU, where verl computes advantages, in the driver), with the metrics on and off
(the baseline), interleaved in this process, one thread; the ratio is on / off of the medians, of
wall time and of this thread's CPU time. Then the metrics alone, against verl-ext's own
``compute_advantage`` for ``mc``; and at the CPU demo's batch (128 responses of 12 tokens) against
the demo's median ``timing_s/step`` when its metrics file is given. Prints figures and ratios;
asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_nonfinite import median_ms, step_batch  # noqa: E402

DEMO_ROWS, DEMO_LENGTH = 128, 12


def session(algorithm, on: bool):
    from omegaconf import OmegaConf

    from verl_ext.integration import step

    config = OmegaConf.create({"algorithm": algorithm, "verl_ext": {"metrics": on, "nonfinite": "off"}})
    return step.fit_session(SimpleNamespace(config=config, global_steps=1), "legacy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--demo-metrics", type=Path, default=None, help="a CPU demo's metrics.jsonl")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from omegaconf import OmegaConf
    from verl.trainer.ppo import ray_trainer

    from verl_ext.integration import metrics_hook

    data = step_batch()
    rows, length = data.batch["response_mask"].shape
    valid = int(data.batch["response_mask"].sum())
    print(f"B x T = {rows} x {length}, {valid / (rows * length):.0%} valid, one thread, torch {torch.__version__}")
    print(f"{'compute_advantage':20s} {'wall: off ms':>12s} {'on ms':>8s} {'on / off':>9s}   {'cpu: off ms':>11s} {'on ms':>8s} {'on / off':>9s}")
    baseline = {}
    for estimator in ("mc", "gae_ext", "grpo"):
        algorithm = OmegaConf.create({"adv_estimator": estimator, "gamma": 0.99, "lam": 0.95})

        def step():
            ray_trainer.compute_advantage(data, adv_estimator=estimator, gamma=0.99, lam=0.95, num_repeat=4, config=algorithm)

        with session(algorithm, False):
            step()  # warm-up
        times = {(clock, on): [] for clock in ("wall", "cpu") for on in (False, True)}
        for _ in range(args.repeats):  # interleaved: the same machine state for both
            for on in (False, True):
                for clock, read in (("wall", time.perf_counter), ("cpu", time.thread_time)):
                    times[clock, on].append(median_ms(step, 1, lambda: session(algorithm, on), read))
        m = {key: statistics.median(values) for key, values in times.items()}
        baseline[estimator] = m["wall", False], m["cpu", False]
        print(
            f"{estimator:20s} {m['wall', False]:12.1f} {m['wall', True]:8.1f} {m['wall', True] / m['wall', False]:9.3f}   "
            f"{m['cpu', False]:11.1f} {m['cpu', True]:8.1f} {m['cpu', True] / m['cpu', False]:9.3f}",
            flush=True,
        )

    def alone(batch):
        return lambda: metrics_hook.live_metrics(batch, 0.99, batch.batch["returns"] - batch.batch["values"])

    wall = median_ms(alone(data), args.repeats)
    cpu = median_ms(alone(data), args.repeats, clock=time.thread_time)
    print(
        f"\nthe metrics alone ({len(alone(data)())} numbers): {wall:.1f} ms wall, {cpu:.1f} ms cpu = "
        f"{wall / baseline['mc'][0]:.2f} x / {cpu / baseline['mc'][1]:.2f} x verl-ext's compute_advantage for mc (off)"
    )
    demo = demo_batch()
    demo_ms = median_ms(alone(demo), 50)
    line = f"at the CPU demo's batch ({DEMO_ROWS} x {DEMO_LENGTH}): {demo_ms:.2f} ms"
    if args.demo_metrics is not None:
        steps = [json.loads(text)["data"] for text in args.demo_metrics.read_text().splitlines()]
        step_s = statistics.median(d["timing_s/step"] for d in steps if "timing_s/step" in d)
        line += f", {demo_ms / (step_s * 1e3):.4%} of the demo's median step ({step_s:.2f} s)"
    print(line)


def demo_batch():
    """A batch of the CPU demo's shape: 128 responses (32 prompts x 4) of up to 12 tokens, the
    reward on the last one."""
    from verl import DataProto

    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(6, DEMO_LENGTH + 1, (DEMO_ROWS,), generator=g)
    mask = (torch.arange(DEMO_LENGTH)[None, :] < lengths[:, None]).float()
    scores = torch.zeros(DEMO_ROWS, DEMO_LENGTH)
    scores[torch.arange(DEMO_ROWS), lengths - 1] = torch.rand(DEMO_ROWS, generator=g)
    values = torch.rand(DEMO_ROWS, DEMO_LENGTH, generator=g) * mask
    returns = scores.flip(-1).cumsum(-1).flip(-1)
    tensors = {
        "response_mask": mask, "token_level_scores": scores, "token_level_rewards": scores, "values": values,
        "returns": returns, "advantages": returns - values,
    }  # fmt: skip
    import numpy as np

    uid = np.array([f"u{i // 4}" for i in range(DEMO_ROWS)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid})


if __name__ == "__main__":
    main()

"""What the update tables cost: verl's update time with and without them, and their bytes per row.

    .venv/bin/python benchmarks/bench_update.py [--steps 16] [--batch 16] [--n 4]

One in-process CPU run of verl's real trainer (the CPU backend, the tiny model, 2 PPO epochs of 2
mini-batches, the trace on with its update tables). Every other step the row key is taken out of
the batch before the updates, so that step's updates run exactly as with ``verl_ext.trace.update=
false``; the two kinds of steps interleave in the same process, so machine noise hits both alike.
The update time is verl's own ``timing_s/update_actor + timing_s/update_critic``; the first two
steps (warm-up) are left out. Prints figures and the ratio; asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=4, help="responses per prompt")
    args = parser.parse_args()

    import verl_ext.cpu

    verl_ext.cpu.activate()
    from verl_ext.tasks.arith.assets import build_assets
    from verl_ext.cpu.in_process import run_in_process
    from verl_ext.apps.learning import read_metrics
    from verl_ext.cpu.overrides import cpu_overrides, merge_overrides
    from verl_ext.integration.update_hook import ROW_KEY
    from verl_ext.trace.reader import open_trace

    out = Path(tempfile.mkdtemp(prefix="bench_update_"))
    responses = args.batch * args.n
    overrides = merge_overrides(
        cpu_overrides(build_assets(), out, steps=args.steps, estimator="mc", train_batch_size=args.batch,
                      rollout_n=args.n, use_ray=False),  # fmt: skip
        [
            f"verl_ext.trace.dir={out / 'trace'}",
            "actor_rollout_ref.actor.ppo_epochs=2",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch // 2}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={responses // 2}",
            "trainer.val_before_train=False",
            "trainer.test_freq=-1",
        ],
    )
    untraced: set[int] = set()

    def alternate(step, batch, trainer):
        if step % 2:  # odd steps: the updates run without the row key, i.e. without update tables
            batch.batch.pop(ROW_KEY)
            untraced.add(step)

    configs = Path(verl_ext.__file__).parent / "configs"
    run_in_process(overrides, on_batch=alternate, config_dir=configs, config_name="verl_ext_trainer")

    metrics = read_metrics(out)
    update = {s: m["timing_s/update_actor"] + m["timing_s/update_critic"] for s, m in metrics.items() if s > 2}
    on = [t for s, t in update.items() if s not in untraced]
    off = [t for s, t in update.items() if s in untraced]
    trace = open_trace(str(out / "trace"))
    rows = sizes = 0
    for kind, steps in trace.update_steps.items():
        for step in steps:
            rows += trace.update_record(kind, step).rows
            sizes += (out / "trace" / trace.update_record(kind, step).file).stat().st_size
    print(f"{responses} responses per step, 2 epochs x 2 mini-batches, {len(on)} + {len(off)} steps measured")
    print(f"update time (actor + critic), median: {statistics.median(off) * 1e3:.1f} ms without update tables, "
          f"{statistics.median(on) * 1e3:.1f} ms with them: ratio {statistics.median(on) / statistics.median(off):.3f}")  # fmt: skip
    print(f"update tables: {rows:,} rows, {sizes / max(rows, 1):.1f} bytes per row on disk")


if __name__ == "__main__":
    sys.exit(main())

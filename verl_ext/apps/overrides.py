"""The hydra overrides (or the environment) of a CPU run of an example task, one per line, for a
shell: ``recipes/cpu_demo.sh`` runs verl's own ``python -m verl.trainer.main_ppo`` with them::

    python -m verl_ext.apps.overrides --output-dir outputs/cpu --steps 5 --estimator gae [--task tool] [--precision bf16] [-- OVERRIDE ...]
    python -m verl_ext.apps.overrides --output-dir outputs/cpu --env
"""

from __future__ import annotations

import argparse

from verl_ext.cpu.overrides import add_precision_argument, cpu_environment, cpu_overrides, merge_overrides
from verl_ext.tasks import DEFAULT_TASK, TASKS, get_task


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print the overrides of a verl CPU run, one per line.")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--assets-dir", default=None, help="asset cache (default: $VERL_EXT_CPU_ASSETS or ~/.cache)")
    parser.add_argument(
        "--task", choices=tuple(TASKS), default=DEFAULT_TASK, help=f"whose model, prompts and reward (default {DEFAULT_TASK})"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--estimator", default="gae")
    parser.add_argument("--train-batch-size", type=int, default=8)
    parser.add_argument("--rollout-n", type=int, default=1)
    add_precision_argument(parser)
    parser.add_argument("--v1", action="store_true", help="verl's V1 trainer (the default trainer of verl 0.9)")
    parser.add_argument("--ray-address", default=None, help="join this running Ray cluster instead of starting one")
    parser.add_argument("--env", action="store_true", help="print the environment as NAME=value lines instead")
    parser.add_argument("extra", nargs="*", help="more overrides; they win over the generated ones")
    args = parser.parse_args(argv)
    if args.env:
        print("\n".join(f"{name}={value}" for name, value in cpu_environment(args.output_dir).items()))
        return
    overrides = cpu_overrides(
        get_task(args.task).build_assets(args.assets_dir),
        args.output_dir,
        steps=args.steps,
        estimator=args.estimator,
        train_batch_size=args.train_batch_size,
        rollout_n=args.rollout_n,
        precision=args.precision,
        use_v1=args.v1,
        ray_address=args.ray_address,
    )
    print("\n".join(merge_overrides(overrides, args.extra)))


if __name__ == "__main__":
    main()

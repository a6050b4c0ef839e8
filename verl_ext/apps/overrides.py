"""The hydra overrides (or the environment) of a CPU run of an example task, one per line, for a
shell: ``recipes/cpu_demo.sh`` runs verl's own ``python -m verl.trainer.main_ppo`` with them::

    python -m verl_ext.apps.overrides --output-dir outputs/cpu --steps 5 --estimator gae [--task tool] [--precision bf16] [--rollout vllm] [-- OVERRIDE ...]
    python -m verl_ext.apps.overrides --output-dir outputs/cpu --env

The overrides are checked first (:func:`verl_ext.apps.composition.checked_config`, against
``--config-path``/``--config-name`` when given): a key verl's config lacks or a value verl-ext refuses
is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from verl_ext.apps.composition import checked_config
from verl_ext.cpu.overrides import (
    add_precision_argument,
    add_rollout_argument,
    cpu_environment,
    cpu_overrides,
    merge_overrides,
)
from verl_ext.errors import UsageError
from verl_ext.options import import_external_modules
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
    add_rollout_argument(parser)
    parser.add_argument("--v1", action="store_true", help="verl's V1 trainer (the default trainer of verl 0.9)")
    parser.add_argument("--ray-address", default=None, help="join this running Ray cluster instead of starting one")
    parser.add_argument("--env", action="store_true", help="print the environment as NAME=value lines instead")
    parser.add_argument("--config-path", default=None, help="the trainer's --config-path (default: verl's own config)")
    parser.add_argument("--config-name", default="ppo_trainer", help="the trainer's --config-name (default: ppo_trainer)")
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
        rollout=args.rollout,
        use_v1=args.v1,
        ray_address=args.ray_address,
    )
    overrides = merge_overrides(overrides, args.extra)
    try:  # a key verl's config lacks or a value verl-ext refuses: one line now, not after Ray started
        import_external_modules()  # a user's estimator is a valid name, as in the run's processes
        checked_config(overrides, args.config_path, args.config_name)
    except UsageError as error:
        print(f"verl-ext: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print("\n".join(overrides))


if __name__ == "__main__":
    main()

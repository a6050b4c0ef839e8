"""The hydra overrides (or the environment) of a CPU run of an example task, one per line, for a
shell: ``recipes/cpu_demo.sh`` runs verl's own ``python -m verl.trainer.main_ppo`` with them::

    python -m verl_ext.apps.overrides --output-dir outputs/cpu --steps 5 --estimator gae [--task tool] [--precision bf16] [--rollout vllm] [--async one_step_off] [-- OVERRIDE ...]
    python -m verl_ext.apps.overrides --output-dir outputs/cpu --env
    python -m verl_ext.apps.overrides --output-dir outputs/cpu --entry-point [--async fully_async]

The overrides are checked first (:func:`verl_ext.apps.composition.checked_config`, against
``--config-path``/``--config-name`` when given, or the config of ``--async``'s trainer): a key verl's
config lacks or a value verl-ext refuses is one line on stderr and exit 2.

verl 0.9.1's asynchronous trainers get what a CPU run of them needs (:func:`verl_ext.cpu.overrides.async_overrides`):
``--async one_step_off`` or ``--async fully_async`` (their own entry points, which ``--entry-point`` prints),
and V1's ``separate_async`` mode when the overrides select it (``trainer.v1.trainer_mode=separate_async``
with ``--v1``; its ``parameter_sync_step`` read from them, verl's 4 by default).
"""

from __future__ import annotations

import argparse
import sys

from verl_ext.apps.composition import checked_config
from verl_ext.cpu.overrides import (
    EXPERIMENTAL_TRAINERS,
    FULLY_ASYNC,
    MAIN_PPO,
    SEPARATE_ASYNC,
    add_precision_argument,
    add_rollout_argument,
    async_overrides,
    check_separate_async,
    compose_config,
    cpu_environment,
    cpu_overrides,
    experimental_config,
    merge_overrides,
    override_key,
    separate_async_steps,
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
    parser.add_argument(
        "--async", dest="async_mode", choices=tuple(EXPERIMENTAL_TRAINERS), default=None,
        help="one of verl's experimental asynchronous trainers, with its own entry point and config (V1's separate_async "
        "is selected by trainer.v1.trainer_mode=separate_async with --v1)",
    )  # fmt: skip
    parser.add_argument("--env", action="store_true", help="print the environment as NAME=value lines instead")
    parser.add_argument("--entry-point", action="store_true", help="print the module the run's python -m runs instead")
    parser.add_argument("--config-path", default=None, help="the trainer's --config-path (default: verl's own config)")
    parser.add_argument("--config-name", default="ppo_trainer", help="the trainer's --config-name (default: ppo_trainer)")
    parser.add_argument("extra", nargs="*", help="more overrides; they win over the generated ones")
    args = parser.parse_args(argv)
    if args.env:
        print("\n".join(f"{name}={value}" for name, value in cpu_environment(args.output_dir).items()))
        return
    if args.entry_point:
        print(EXPERIMENTAL_TRAINERS[args.async_mode][0] if args.async_mode else MAIN_PPO)
        return
    config_path, config_name = args.config_path, args.config_name
    if args.async_mode is not None:
        refusal = _async_refusal(args)
        if refusal:
            print(f"verl-ext: {refusal}", file=sys.stderr)
            raise SystemExit(2)
        config_path, config_name = experimental_config(args.async_mode)
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
    try:  # a key verl's config lacks or a value verl-ext refuses: one line now, not after Ray started
        import_external_modules()  # a user's estimator is a valid name, as in the run's processes
        overrides = merge_overrides(overrides, _mode_overrides(args, overrides, config_path, config_name), args.extra)
        # verl's fully-async entry point does not run verl's validate_config, which refuses its data.train_batch_size=0
        check_separate_async(checked_config(overrides, config_path, config_name, verl_validates=args.async_mode != FULLY_ASYNC))
    except UsageError as error:
        print(f"verl-ext: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print("\n".join(overrides))


def _async_refusal(args) -> str | None:
    """Why ``--async`` cannot go with the other options; None if it can."""
    if args.v1:
        return (
            f"--async {args.async_mode} runs verl's own trainer of that mode ({EXPERIMENTAL_TRAINERS[args.async_mode][0]}), "
            "not the V1 trainer: leave out --v1 (V1=1); V1's asynchronous mode is trainer.v1.trainer_mode=separate_async"
        )
    if args.config_path:
        return (
            f"--async {args.async_mode} composes verl's own config of that trainer: leave out --config-path (CONFIG_PATH) "
            "and add verl-ext's options as +verl_ext.<option>=<value>"
        )
    return None


def _mode_overrides(args, overrides: list[str], config_path, config_name: str) -> list[str]:
    """What the run's asynchronous mode needs on a CPU (verl_ext.cpu.overrides.async_overrides); [] for none."""
    common = dict(steps=args.steps, rollout_n=args.rollout_n, ray_address=args.ray_address)
    if args.async_mode == FULLY_ASYNC:
        # the prompts of an update and the updates between two weight syncs, as the user's overrides set them
        mini = _value(args.extra, "actor_rollout_ref.actor.ppo_mini_batch_size")
        trigger = _value(args.extra, "async_training.trigger_parameter_sync_step")
        return async_overrides(
            FULLY_ASYNC, train_batch_size=int(mini or args.train_batch_size), trigger_parameter_sync_step=int(trigger or 1), **common
        )
    if args.async_mode is not None:
        return async_overrides(args.async_mode, train_batch_size=args.train_batch_size, **common)
    try:  # V1's separate_async, where the user's overrides (or the config) select it
        config = compose_config(merge_overrides(overrides, args.extra), config_path, config_name)
    except Exception:  # noqa: BLE001 - the check that follows says what is wrong, in one line
        return []
    steps = separate_async_steps(config)
    if steps is None:
        return []
    return async_overrides(
        SEPARATE_ASYNC, train_batch_size=int(config.data.train_batch_size), parameter_sync_step=steps,
        **{**common, "rollout_n": int(config.actor_rollout_ref.rollout.n)},
    )  # fmt: skip


def _value(overrides: list[str], key: str) -> str | None:
    """The value the last of ``overrides`` that sets ``key`` gives it; None when none does."""
    values = [override.split("=", 1)[1] for override in overrides if "=" in override and override_key(override) == key]
    return values[-1] if values else None


if __name__ == "__main__":
    main()

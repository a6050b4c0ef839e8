"""``verl-ext demo``: its arguments and its run."""

from __future__ import annotations

import argparse
from pathlib import Path

from verl_ext.apps.demo import check_demo, run_demo
from verl_ext.cli.common import at_least, require_writable
from verl_ext.cpu.overrides import add_precision_argument, add_rollout_argument, engine_rollout
from verl_ext.tasks import DEFAULT_TASK, TASKS


def arguments(parser: argparse.ArgumentParser) -> None:
    others = [task for task in TASKS.values() if task.name != DEFAULT_TASK]

    def by_task(field: str) -> str:
        """The default task's ``field``, then each other task's: "40; 25 with --task tool"."""
        return "; ".join([str(getattr(TASKS[DEFAULT_TASK], field)), *(f"{getattr(task, field)} with --task {task.name}" for task in others)])

    parser.add_argument("--output-dir", type=Path, default=Path("outputs/demo"), help="default: outputs/demo")
    parser.add_argument("--steps", type=at_least(1), default=None, help=f"training steps (default {by_task('steps')})")
    parser.add_argument("--task", choices=tuple(TASKS), default=DEFAULT_TASK, help=", or ".join([f"{DEFAULT_TASK} (default)", *(f"{task.name}: {task.summary}" for task in others)]))
    parser.add_argument("--estimator", default=None, help=f"algorithm.adv_estimator (default {by_task('estimator')})")
    parser.add_argument("--seed", type=at_least(0), default=0, help="seed of the data order and the sampling (default 0)")
    add_precision_argument(parser, "the CPU backend's: ")
    add_rollout_argument(parser, default=engine_rollout())  # the engine real runs use, where vLLM's CPU build is installed
    parser.add_argument("--sample", type=at_least(0), default=None, help="response shown token by token (default: a wrong answer whose verdict gets a negative advantage, else one with a verdict and a score below 1; with --task tool, one that called the tool; the demo prints which and why)")
    parser.add_argument(
        "--turn-rewards", action="store_true",
        help="add the agent loop's per-turn rewards to the rewards (verl_ext.turn_rewards=true; with --task tool, the calculator's 0.1 for a well-formed call)",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="more hydra overrides for the trainer; they win")


def run(args: argparse.Namespace) -> int:
    check_demo(args)  # a bad estimator or override: one line now, before any folder or trainer
    require_writable(args.output_dir, "the demo's outputs")
    return run_demo(args)

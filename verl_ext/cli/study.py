"""``verl-ext study``: its arguments and its run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from verl_ext.apps.learning import ESTIMATOR_OPTIONS, STEPS, TEST_FREQ
from verl_ext.apps.study import StudySettings, run_study, study_estimators
from verl_ext.cli.common import require_writable
from verl_ext.errors import UsageError
from verl_ext.tasks import DEFAULT_TASK, TASKS, get_task


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--estimators", metavar="E,E,…",
        help=f"default: {','.join(ESTIMATOR_OPTIONS)} and every other registered estimator (VERL_USE_EXTERNAL_MODULES)",
    )  # fmt: skip
    parser.add_argument(
        "--task", choices=tuple(TASKS), default=DEFAULT_TASK,
        help=f"{DEFAULT_TASK} (default), or tool: the tool task, with its calls and the credit by turn in the outputs",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 … N-1 per estimator (default 3)")
    parser.add_argument(
        "--steps", type=int, default=None,
        help=f"PPO steps per run (default: the task's, {STEPS}; {TASKS['tool'].steps} with --task tool)",
    )  # fmt: skip
    parser.add_argument("--test-freq", type=int, default=TEST_FREQ, metavar="F", help=f"validate every F steps (default {TEST_FREQ})")
    parser.add_argument("--threshold", type=float, default=0.8, help="held-out accuracy for 'steps to threshold' (default 0.8)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs at a time (default: 2, or 1 on one core)")
    parser.add_argument(
        "--control", action="store_true",
        help="also run every estimator that uses a critic with a fresh critic instead of the pretrained one",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")


def run(args: argparse.Namespace) -> int:
    estimators = study_estimators(args.estimators)
    if args.steps is None:
        args.steps = get_task(args.task).steps
    for name, value in (("--seeds", args.seeds), ("--steps", args.steps), ("--test-freq", args.test_freq), ("--jobs", args.jobs)):
        if value < 1:
            raise UsageError(f"{name} must be an integer >= 1, got {value}")
    if not 0.0 <= args.threshold <= 1.0:
        raise UsageError(f"--threshold must be in [0, 1], got {args.threshold}")
    require_writable(args.out, "the study's outputs")
    settings = StudySettings(args.steps, args.test_freq, args.threshold, args.task)
    return run_study(estimators, args.seeds, settings, args.out.resolve(), args.jobs, args.control)

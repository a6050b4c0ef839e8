"""``verl-ext compare``: its arguments and its run."""

from __future__ import annotations

import argparse

from verl_ext.cli.common import LAST_READABLE, at_least, emit, format_arguments, headless_matplotlib, run_argument, say, tokenizer_argument
from verl_ext.cli.traces import one_step, open_run
from verl_ext.errors import UsageError
from verl_ext.inspect.comparison import compare as compare_step, comparison_report
from verl_ext.options import TRUNCATION_MODES
from verl_ext.steps.as_run import DEFAULT_LAMBDAS, DEFAULT_N
from verl_ext.steps.cuts import last_step_with_cuts


def _lambdas(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if any(not 0.0 <= value <= 1.0 for value in values):
        raise argparse.ArgumentTypeError(f"every λ must be in [0, 1], got {text}")
    return values


def arguments(parser: argparse.ArgumentParser) -> None:
    run_argument(parser)
    parser.add_argument(
        "--step", type=int, metavar="S",
        help=f"the traced step to re-estimate (default: {LAST_READABLE}; with --truncation, the last step with a "
        "response cut at the length limit)",
    )  # fmt: skip
    parser.add_argument("--sample", type=at_least(0), default=0, metavar="I", help="sample of the per-token table (default 0)")
    parser.add_argument("--n", type=at_least(1), default=DEFAULT_N, help=f"n of the n-step estimator (default {DEFAULT_N})")
    lambdas = ",".join(f"{lam:g}" for lam in DEFAULT_LAMBDAS)
    parser.add_argument("--lambdas", type=_lambdas, default=DEFAULT_LAMBDAS, metavar="L,L,…", help=f"λ of the GAE columns (default {lambdas})")
    parser.add_argument("--plot", metavar="PNG", help="also draw the comparison into this PNG file")
    parser.add_argument(
        "--truncation", nargs="?", type=_truncation_mode, const=None, default=argparse.SUPPRESS, metavar="MODE",
        help=f"compare the treatments of responses cut at the length limit: the run's estimator under "
        f"{', '.join(TRUNCATION_MODES)} side by side, on the last step with cut responses unless --step; MODE: how the "
        "estimator columns treat them (default, and a bare --truncation: as the run did, its algorithm.truncation). "
        "Without --truncation a step with cut responses shows the treatments too (docs/definitions.md#truncated-responses)",
    )  # fmt: skip
    tokenizer_argument(parser)
    format_arguments(parser)


def _truncation_mode(text: str) -> str:
    """An argparse type: one of TRUNCATION_MODES (a bad one is argparse's one-line error, exit 2)."""
    if text not in TRUNCATION_MODES:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(TRUNCATION_MODES)})")
    return text


def run(args: argparse.Namespace) -> int:
    trace = open_run(args.run)
    about_truncation = hasattr(args, "truncation")  # --truncation given, with or without a mode
    mode = getattr(args, "truncation", None)
    step = args.step
    if step is None and about_truncation:
        step = last_step_with_cuts(trace)
        if step is None:
            say([f"no step of {trace.path} has a response cut at the length limit (or the trace records no truncated flags): comparing the last step"])
    _, comparison = one_step(
        trace, step, lambda step: compare_step(trace, step, args.sample, args.n, args.lambdas, args.tokenizer, mode)
    )
    if args.plot:
        headless_matplotlib("--plot")
        try:
            comparison.figure().savefig(args.plot, dpi=130)
        except OSError as error:
            raise UsageError(f"cannot write {args.plot}: {error.strerror or error}") from None
    emit(comparison_report(comparison, args.format, args.digits))
    return 0

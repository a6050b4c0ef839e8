"""``verl-ext plot``: its arguments and its run."""

from __future__ import annotations

import argparse

from verl_ext.cli.common import (
    LAST_READABLE, emit, headless_matplotlib, quiet_argument, refuse_unusable_directory, run_argument, say, tokenizer_argument,
)  # fmt: skip
from verl_ext.cli.traces import STEPS_LEFT_OUT_EPILOG, left_out, open_run, parallel_arguments, parallel_options, progress_printer
from verl_ext.errors import StepFileError
from verl_ext.errors import UsageError
from verl_ext.inspect.plots import save_plots_with_notes
from verl_ext.inspect.unread import UnreadSteps


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = STEPS_LEFT_OUT_EPILOG
    run_argument(parser)
    parser.add_argument(
        "--out", default="verl-ext-plots", metavar="DIR",
        help="output directory (default: ./verl-ext-plots); one that cannot be (a file is there) is refused before any step is read",
    )  # fmt: skip
    parser.add_argument("--step", type=int, metavar="S", help=f"step of the per-step figures (default: {LAST_READABLE})")
    parser.add_argument("--sample", type=int, default=0, metavar="I", help="sample of the token heatmap (default 0)")
    tokenizer_argument(parser)
    parallel_arguments(parser)
    quiet_argument(parser)




def run(args: argparse.Namespace) -> int:
    headless_matplotlib("plot")
    refuse_unusable_directory(args.out, "the figures")  # before the steps are read, which takes a while

    trace = open_run(args.run)
    unread = UnreadSteps.of(trace)
    try:
        paths, notes = save_plots_with_notes(
            trace, args.out, args.step, args.sample, args.tokenizer, progress_printer(args, "plot: scanning steps"), unread, **parallel_options(args)
        )
    except StepFileError as error:  # a file of the step the per-step figures draw
        raise UsageError(f"step {error.step} does not read: {error}") from None
    except OSError as error:
        raise UsageError(f"cannot write the figures to {args.out}: {error.strerror or error}") from None
    say(notes)
    emit("\n".join(map(str, paths)))
    return left_out(unread)

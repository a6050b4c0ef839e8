"""``verl-ext show``: its arguments and its run."""

from __future__ import annotations

import argparse
import sys

from verl_ext.cli.common import LAST_READABLE, emit, format_arguments, run_argument, tokenizer_argument
from verl_ext.cli.traces import one_step, open_run
from verl_ext.inspect.render import render
from verl_ext.inspect.table import decoder_for, first_sample_with_tool_call, sample_view
from verl_ext.steps.recorded import RecordedAlgorithm


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "A step whose file does not read (cut short, moved) is one line and exit 2 with --step; without it, "
        "the last step that reads is shown and a note on stderr names the later ones."
    )
    run_argument(parser)
    parser.add_argument("--step", type=int, metavar="S", help=f"step (default: {LAST_READABLE})")
    sample = parser.add_mutually_exclusive_group()
    sample.add_argument("--sample", type=int, metavar="I", help="sample (row in the step's batch; default 0)")
    sample.add_argument(
        "--with-tool-call", action="store_true",
        help="the step's first sample whose response called a tool (a tool's message is in it, shown between ⟦ ⟧); "
        "one line and exit 2 when no response of the step did",
    )  # fmt: skip
    parser.add_argument(
        "--epoch", type=int, metavar="E", help="add what the update of PPO epoch E did: mini-batch, log-prob, ratio, clip, loss terms"
    )
    tokenizer_argument(parser)
    format_arguments(parser)




def run(args: argparse.Namespace) -> int:
    trace = open_run(args.run)
    decoder = decoder_for(trace, args.tokenizer)

    def view_of(step: int):
        sample = first_sample_with_tool_call(trace, step) if args.with_tool_call else (args.sample or 0)
        return sample_view(trace, step, sample, decoder, epoch=args.epoch)

    _, view = one_step(trace, args.step, view_of)
    if not decoder.available:  # said after the step was read, so that a bad trace stays a one-line error
        print(f"note: {decoder.problem}; tokens are shown as ids", file=sys.stderr)
    if args.format != "csv":
        prefix = "" if args.format == "text" else "- "
        header = view.header(RecordedAlgorithm.from_record(trace.record))
        emit("\n".join(prefix + line for line in header) + "\n")
    emit(render(view.table, args.format, args.digits))
    return 0

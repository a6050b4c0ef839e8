"""``verl-ext show RUN --step S --sample I``: one sample's per-token table with decoded tokens."""

from __future__ import annotations

import argparse
import sys

from verl_ext.inspect.commands import common

HELP = "print one sample's per-token table: token, mask, score, kl, reward, value, δ, return, advantages"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_run(parser)
    parser.add_argument("--step", type=int, metavar="S", help="step (default: the first traced step)")
    parser.add_argument(
        "--sample", type=int, default=0, metavar="I", help="sample (row in the step's batch; default 0)"
    )
    common.add_tokenizer(parser)
    common.add_format(parser)


def run(args: argparse.Namespace) -> int:
    from verl_ext.inspect.recorded import RecordedAlgorithm
    from verl_ext.inspect.render import render
    from verl_ext.inspect.table import sample_view
    from verl_ext.inspect.tokens import decoder_for, visible

    trace = common.open_run(args.run)
    step = trace.steps[0] if args.step is None else args.step
    decoder = decoder_for(trace, args.tokenizer)
    view = sample_view(trace, step, args.sample, decoder)
    if not decoder.available:  # said after the step was read, so that a bad trace stays a one-line error
        print(f"note: {decoder.problem}; tokens are shown as ids", file=sys.stderr)
    if args.format != "csv":
        algorithm = RecordedAlgorithm.from_record(trace.record)
        prefix = "" if args.format == "text" else "- "
        header = [
            f"step {view.step} · sample {view.sample} · uid {view.uid} · {view.table.num_rows} tokens "
            f"({view.valid_tokens} valid) · {algorithm.describe()}",
        ]
        if view.prompt_text is not None:
            header.append(f"prompt:   {visible(view.prompt_text, show_spaces=False)}")
        if view.response_text is not None:
            header.append(f"response: {visible(view.response_text, show_spaces=False)}")
        print("\n".join(prefix + line for line in header) + "\n")
    print(render(view.table, args.format, args.digits))
    return 0

"""``verl-ext plot RUN``: PNG figures of a trace in an output directory."""

from __future__ import annotations

import argparse
import sys
import warnings

from verl_ext.errors import UsageError
from verl_ext.inspect.commands import common

HELP = (
    "write PNG figures: per-position curves, score and explained variance over steps, value vs return, a token heatmap"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_run(parser)
    parser.add_argument(
        "--out", default="verl-ext-plots", metavar="DIR", help="output directory (default: ./verl-ext-plots)"
    )
    parser.add_argument(
        "--step", type=int, metavar="S", help="step of the per-step figures (default: the last traced step)"
    )
    parser.add_argument("--sample", type=int, default=0, metavar="I", help="sample of the token heatmap (default 0)")
    common.add_tokenizer(parser)
    common.add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        raise UsageError("plot needs matplotlib: pip install 'verl-ext[plot]'") from None
    from verl_ext.inspect.plots import PlotNote, save_plots
    from verl_ext.inspect.progress import ProgressPrinter
    from verl_ext.inspect.tokens import decoder_for

    trace = common.open_run(args.run)
    decoder = decoder_for(trace, args.tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PlotNote)
        try:
            progress = None if args.quiet else ProgressPrinter("plot: scanning steps")
            paths = save_plots(trace, args.out, args.step, args.sample, decoder, progress)
        except OSError as error:
            raise UsageError(f"cannot write the figures to {args.out}: {error.strerror or error}") from None
    notes = [str(w.message) for w in caught if issubclass(w.category, PlotNote)]
    if not decoder.available:
        notes.insert(0, f"{decoder.problem}; the heatmap shows token ids")
    for message in dict.fromkeys(notes):  # each distinct note once
        print(f"note: {message}", file=sys.stderr)
    for path in paths:
        print(path)
    return 0

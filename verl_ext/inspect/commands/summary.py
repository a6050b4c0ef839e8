"""``verl-ext summary RUN``: one line of statistics per traced step."""

from __future__ import annotations

import argparse

from verl_ext.inspect.commands import common

HELP = "one line per step: tokens, score, reward, KL, value/return/advantage stats, explained variance"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common.add_run(parser)
    common.add_format(parser)
    common.add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    from verl_ext.inspect.progress import ProgressPrinter
    from verl_ext.inspect.render import render
    from verl_ext.inspect.summary import summarize

    trace = common.open_run(args.run)
    table = summarize(trace, progress=None if args.quiet else ProgressPrinter("summary"))
    print(render(table, args.format, args.digits))
    return 0

"""Arguments and helpers the inspection subcommands share."""

from __future__ import annotations

import argparse

from verl_ext.errors import UsageError
from verl_ext.inspect.render import FORMATS


def add_run(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run", metavar="RUN", help="trace directory (verl_ext.trace.dir of the run), local path or fsspec URL"
    )


def add_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=FORMATS, default="text", help="output format (default: text)")
    parser.add_argument("--digits", type=int, default=4, help="decimals shown in text and markdown (default: 4)")


def add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def add_tokenizer(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="tokenizer directory (default: the run record's tokenizer_path); local files only",
    )


def open_run(path: str):
    """The trace at ``path``, refusing one without any traced step."""
    from verl_ext.trace.reader import open_trace

    trace = open_trace(path)
    if not trace.steps:
        raise UsageError(f"{path} has no traced steps yet")
    return trace


def choose_steps(trace, wanted: list[int] | None) -> list[int]:
    if not wanted:
        return list(trace.steps)
    return sorted({trace.require_step(step) for step in wanted})

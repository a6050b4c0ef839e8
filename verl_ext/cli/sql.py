"""``verl-ext sql``: its arguments and its run."""

from __future__ import annotations

import argparse
import json

from verl_ext.cli.common import FORMATS, at_least, emit, run_argument, tokenizer_argument
from verl_ext.cli.traces import open_run
from verl_ext.inspect.render import render
from verl_ext.inspect.sql import VIEWS, query


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        f"Views: {', '.join(VIEWS)}, every step of the trace, joinable on (step, sample, token_index); tokens has "
        "`token`, decoded by the run's tokenizer. Examples: docs/inspecting.md#sql-over-a-trace. A query DuckDB "
        "refuses is one line and exit 2."
    )
    run_argument(parser)
    parser.add_argument("query", help='one SQL statement, e.g. "SELECT step, avg(advantage) FROM tokens WHERE mask GROUP BY step"')
    parser.add_argument("--format", choices=(*FORMATS, "json"), default="text", help="output format (default: text)")
    parser.add_argument("--digits", type=at_least(0), default=4, help="decimals shown in text and markdown (default: 4)")
    tokenizer_argument(parser)


def run(args: argparse.Namespace) -> int:
    table = query(open_run(args.run), args.query, args.tokenizer)
    if args.format == "json":
        emit(json.dumps(table.to_pylist(), indent=2, ensure_ascii=False, default=str))
    else:
        emit(render(table, args.format, args.digits))
    return 0

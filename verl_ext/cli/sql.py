"""``verl-ext sql``: its arguments and its run."""

from __future__ import annotations

import argparse
import json

from verl_ext.cli.common import FORMATS, at_least, emit, run_argument, tokenizer_argument
from verl_ext.cli.traces import STEPS_LEFT_OUT, left_out, open_run
from verl_ext.inspect.render import render
from verl_ext.inspect.sql import VIEWS, query
from verl_ext.inspect.unread import UnreadSteps


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        f"Views: {', '.join(VIEWS)}, every step of the trace, joinable on (step, sample, token_index); tokens has "
        "`token`, decoded by the run's tokenizer. Examples: docs/inspecting.md#sql-over-a-trace. Read-only: the "
        "query reads the trace's tables and nothing else (no other file, no setting changed) and writes nothing; "
        "in-memory tables are allowed. Exit code: 0; 2 for a query DuckDB refuses (one line), a statement that would "
        "read or write a file or change a setting among them; "
        f"{STEPS_LEFT_OUT} when a step was left out of the views, the result covering the others: one the run record "
        "lists but the disk lacks, or one whose file does not read (cut short, moved), each said in one line on "
        "stderr; 130 on Ctrl-C, which stops the query at once."
    )
    run_argument(parser)
    parser.add_argument("query", help='one SQL statement, e.g. "SELECT step, avg(advantage) FROM tokens WHERE mask GROUP BY step"')
    parser.add_argument("--format", choices=(*FORMATS, "json"), default="text", help="output format (default: text)")
    parser.add_argument("--digits", type=at_least(0), default=4, help="decimals shown in text and markdown (default: 4)")
    tokenizer_argument(parser)


def run(args: argparse.Namespace) -> int:
    trace = open_run(args.run)
    unread = UnreadSteps.of(trace)
    table = query(trace, args.query, args.tokenizer, unread)
    if args.format == "json":
        emit(json.dumps(table.to_pylist(), indent=2, ensure_ascii=False, default=str))
    else:
        emit(render(table, args.format, args.digits))
    return left_out(unread)

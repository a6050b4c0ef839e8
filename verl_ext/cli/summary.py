"""``verl-ext summary``: its arguments and its run."""

from __future__ import annotations

import argparse

from verl_ext.cli.common import emit, format_arguments, quiet_argument, run_argument, say
from verl_ext.cli.traces import STEPS_LEFT_OUT_EPILOG, left_out, open_run, parallel_arguments, parallel_options, progress_printer, run_header
from verl_ext.inspect.critic import critic_diagnostics, critic_report
from verl_ext.inspect.render import render
from verl_ext.inspect.summary import blank_notes, offpolicy_notes, summarize
from verl_ext.inspect.unread import UnreadSteps
from verl_ext.step_metrics import MIN_EV_TOKENS
from verl_ext.steps.recorded import RecordedAlgorithm


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = STEPS_LEFT_OUT_EPILOG
    run_argument(parser)
    parser.add_argument(
        "--critic",
        action="store_true",
        help="instead, the critic by position: explained variance of the values against the Monte-Carlo return "
        f"(blank for a bucket of fewer than {MIN_EV_TOKENS} tokens), the tokens and mean |V − G|, per step and decile of the response "
        "(CSV: one row per step and bucket)",
    )
    parallel_arguments(parser)
    format_arguments(parser)
    quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    trace = open_run(args.run)
    unread = UnreadSteps.of(trace)
    if args.critic:
        return _critic_summary(trace, args, unread)
    table = summarize(trace, progress=progress_printer(args, "summary"), unread=unread, **parallel_options(args))
    emit(run_header(trace, args.format) + render(table, args.format, args.digits))
    say(blank_notes(trace, table) + offpolicy_notes(table))
    return left_out(unread)


def _critic_summary(trace, args: argparse.Namespace, unread) -> int:
    """``summary --critic``: steps × position buckets, EV then mean |V − G| (CSV: the long table)."""
    diagnostics = critic_diagnostics(trace, progress=progress_printer(args, "summary --critic"), unread=unread, **parallel_options(args))
    gamma = RecordedAlgorithm.from_record(trace.record).gamma
    emit(run_header(trace, args.format) + critic_report(diagnostics, gamma, args.format, args.digits))
    return left_out(unread)

"""``verl-ext summary``: its arguments and its run."""

from __future__ import annotations

import argparse

from verl_ext.cli.common import emit, format_arguments, quiet_argument, run_argument, say
from verl_ext.cli.traces import STEPS_LEFT_OUT_EPILOG, left_out, open_run, parallel_arguments, parallel_options, progress_printer, run_header
from verl_ext.errors import UsageError
from verl_ext.inspect.critic import critic_diagnostics, critic_report
from verl_ext.inspect.offpolicy import by_staleness, staleness_report
from verl_ext.inspect.render import render
from verl_ext.inspect.summary import blank_notes, offpolicy_notes, summarize
from verl_ext.inspect.unread import UnreadSteps
from verl_ext.step_metrics import MIN_EV_TOKENS
from verl_ext.steps.recorded import RecordedAlgorithm
from verl_ext.steps.versions import may_be_asynchronous


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
    parser.add_argument(
        "--by-staleness", action="store_true",
        help="instead, for a run of verl's asynchronous trainers, per step and staleness level s (the responses trained s weight "
        "updates after the policy that generated them): the responses, tokens, update rows, mean and largest |ratio − 1|, the "
        "share clipped, the mean importance weight and mean |log π_old − log π_rollout|, then each level over every step "
        "(docs/definitions.md#policy-versions)",
    )  # fmt: skip
    parallel_arguments(parser)
    format_arguments(parser)
    quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    trace = open_run(args.run)
    unread = UnreadSteps.of(trace)
    if args.critic and args.by_staleness:
        raise UsageError("--critic and --by-staleness: choose one")
    if args.critic:
        return _critic_summary(trace, args, unread)
    if args.by_staleness:
        return _staleness_summary(trace, args, unread)
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


def _staleness_summary(trace, args: argparse.Namespace, unread) -> int:
    """``summary --by-staleness``: steps × staleness levels, then each level over every step."""
    if not may_be_asynchronous(trace.record):
        raise UsageError(f"{trace.path} is not of an asynchronous run (it records no policy versions: {_why_synchronous(trace.record)}): "
                         "there is no staleness to group by")  # fmt: skip
    table = by_staleness(trace, progress=progress_printer(args, "summary --by-staleness"), unread=unread, **parallel_options(args))
    if not table.num_rows:
        raise UsageError(f"no step of {trace.path} has a staleness: no response's policy version, or no trainer version, is recorded")
    emit(run_header(trace, args.format) + staleness_report(table, args.format, args.digits))
    return left_out(unread)


def _why_synchronous(record) -> str:
    return "a trace before format 11" if record.schema_version < 11 else "its mode is sync"

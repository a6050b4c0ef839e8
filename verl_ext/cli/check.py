"""``verl-ext check``: its arguments and its run."""

from __future__ import annotations

import argparse
import json

from verl_ext.check.run import check_trace
from verl_ext.cli.common import emit, quiet_argument, run_argument
from verl_ext.cli.traces import open_run, parallel_arguments, parallel_options, progress_printer
from verl_ext.inspect.render import format_report


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        f"Exit code: 0 pass, 1 fail (an identity is violated), 2 bad input, {CHECK_INCOMPLETE} incomplete: nothing "
        "failed, but an identity that applies to the run could not be evaluated here (the last line says which "
        "and why; not PASS). Identities that do not apply (no critic, whitening off, ...) are skipped. A step the run "
        "record lists that is not on disk, or whose file does not read (cut short, moved), fails, naming the file; "
        "every other step is checked. A run that did not finish (killed, interrupted, failed) passes on the steps it "
        "wrote, its verdict ending with how far it got: PASS (...; 8 of 40 planned steps; the run did not finish)."
    )
    run_argument(parser)
    parser.add_argument("--step", type=int, action="append", metavar="S", help="check only step S (repeatable)")
    parallel_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--allow-unchecked", action="store_true",
        help=f"exit 0, not {CHECK_INCOMPLETE}, when identities that apply to the run could not be evaluated here "
        "(e.g. its estimator's module does not import); the verdict still names them",
    )  # fmt: skip
    quiet_argument(parser)


#: ``check``'s exit code when nothing failed but an identity that applies was not evaluated.
CHECK_INCOMPLETE = 3


def run(args: argparse.Namespace) -> int:
    trace = open_run(args.run)
    steps = sorted({trace.require_step(step) for step in args.step}) if args.step else None
    report = check_trace(trace, steps, progress=progress_printer(args, "check"), **parallel_options(args))
    if args.json:
        emit(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
    else:
        emit(format_report(report, accept_unchecked=args.allow_unchecked))
    if report.verdict == "incomplete":
        return 0 if args.allow_unchecked else CHECK_INCOMPLETE
    return 0 if report.passed else 1

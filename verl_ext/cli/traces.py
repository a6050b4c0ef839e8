"""What the commands that read a trace share: opening it, its header, the steps a scan left out,
progress lines, steps in parallel, and the one step a command shows."""

from __future__ import annotations

import argparse
from typing import Callable

from verl_ext.cli.common import at_least, say
from verl_ext.errors import StepFileError, UsageError
from verl_ext.inspect.render import ProgressPrinter
from verl_ext.inspect.unread import UnreadSteps, last_step_that_reads
from verl_ext.steps.recorded import RecordedRun
from verl_ext.steps.versions import describe_mode
from verl_ext.trace.parallel import MIN_PARALLEL_ROWS, default_jobs
from verl_ext.trace.reader import open_trace

#: The exit code of a command that walks the steps when it left some out (missing or unreadable).
STEPS_LEFT_OUT = 1
STEPS_LEFT_OUT_EPILOG = (
    f"Exit code: 0; {STEPS_LEFT_OUT} when a step was left out, the output covering the others: a step the run "
    "record lists but the disk lacks, or one whose file does not read (cut short, moved), each said in one line "
    "on stderr; 2 bad input."
)


def open_run(path: str):
    """The trace at ``path``, refusing one without any traced step."""
    if not path.strip():
        raise UsageError("RUN must be a trace directory or URL, got an empty string")
    trace = open_trace(path)
    if not trace.steps:
        raise UsageError(f"{path} has no traced steps yet")
    return trace


def run_header(trace, fmt: str) -> str:
    """The run's rollout engine, whether it finished and, for an asynchronous trainer, its mode, as a header of
    the output ("" for CSV)."""
    if fmt == "csv":
        return ""
    run = RecordedRun.of(trace)
    prefix = "" if fmt == "text" else "- "
    mode = describe_mode(trace.record.mode)  # an asynchronous trainer's (docs/definitions.md#policy-versions)
    return f"{prefix}rollout:  {run.describe_rollout()}\n{prefix}finished: {run.describe_end()}\n" + (f"{prefix}mode:     {mode}\n" if mode else "") + "\n"


def left_out(unread) -> int:
    """Say which steps a scan left out and why; the command's exit code."""
    say(unread.lines())
    return STEPS_LEFT_OUT if unread else 0


def progress_printer(args, what: str):
    return None if args.quiet else ProgressPrinter(what)


def parallel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--jobs", type=at_least(1), default=default_jobs(), metavar="N",
        help=f"steps in N processes at once (default: the {default_jobs()} cores here; one process for a trace under "
        f"{MIN_PARALLEL_ROWS // 1_000_000}M token rows, where starting them costs more); the output is the same",
    )  # fmt: skip
    parser.add_argument(
        "--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
        help="steps as Ray tasks on the cluster at ADDRESS (default: the one RAY_ADDRESS names, else a new one "
        "here); every node must read the trace at its path",
    )  # fmt: skip


def parallel_options(args) -> dict:
    return {"jobs": args.jobs, "ray_address": args.ray}


def one_step(trace, step: int | None, read: Callable):
    """(step, ``read(step)``): of ``step``, whose files must read (else one line, exit 2); without it,
    of the last step that reads, with a note naming the later ones left out."""
    if step is not None:
        trace.require_step(step)
        try:
            return step, read(step)
        except StepFileError as error:
            raise UsageError(f"step {step} does not read: {error}") from None
    unread = UnreadSteps.of(trace)
    step, value = last_step_that_reads(trace, unread, read)
    unread.missing = [missing for missing in unread.missing if missing > step]  # the ones before it are not the point
    if unread:
        say([*unread.lines(), f"showing step {step}, the last step that reads"])
    return step, value

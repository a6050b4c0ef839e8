"""``verl-ext view``: its arguments and its run."""

from __future__ import annotations

import argparse
import sys

from verl_ext.cli.common import LAST_READABLE, at_least, emit, quiet_argument, run_argument, say, tokenizer_argument
from verl_ext.cli.traces import left_out, one_step, open_run, parallel_arguments, parallel_options, progress_printer
from verl_ext.errors import UsageError
from verl_ext.inspect.table import decoder_for
from verl_ext.inspect.unread import UnreadSteps, last_step_that_reads, step_reads
from verl_ext.view.page import DEFAULT_MAX_TOKENS, start_group, write_page
from verl_ext.view.server import DEFAULT_HOST, DEFAULT_PORT, serve

VIEW_EPILOG = """\
Without --out, the whole trace is served from {host} and the URL printed; each step is read when
the page asks for it, so a trace of any size opens at once. Read-only; only the trace's own data is
served. From a remote machine: ssh -L {port}:127.0.0.1:{port} HOST, then open the printed URL locally.
--host 0.0.0.0 serves to the network (anyone who can reach the port can read the trace).

A step whose file does not read (cut short, moved) is left out and named in a note, on stderr and on
the page; a step the run record lists but the disk lacks is named too. With --out the exit code is then
1 (the file holds the other steps); --step of such a step is one line and exit 2.

With --out, one self-contained HTML file (script, style and data inline; it fetches nothing, so it
opens from a laptop after scp, from a CI artifact, attached to a pull request). Which steps go into
it: the --steps listed, or every step when the trace holds at most --max-tokens token rows in all;
else the --step first, then steps spread evenly over the run (first and last, middle, quarters, ...)
while they fit in --max-tokens. A step larger than the budget left keeps its first responses only
(the --sample and its group always), and the page says so. A file costs about 150 bytes per token
row (about 40 more per PPO epoch of update tables): the default {max_tokens} rows keep it near 30 MB. The
summary, comparison and check of every step in the file cover all of its responses.

Either way the page shows each response token by token, coloured by a chosen quantity, with every
number of a token on hover; the step's summary, the estimators compared, and the check's failures
linked to their (step, sample, token)."""


def _step_list(text: str) -> list[int]:
    """An argparse type: ``1,5,10-20`` as a sorted list of steps."""
    steps: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            steps.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of steps such as 1,5,10-20") from None
    if not steps:
        raise argparse.ArgumentTypeError(f"{text!r} names no step")
    return sorted(steps)


def _port(text: str) -> int:
    value = at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be <= 65535, got {value}")
    return value


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = VIEW_EPILOG.format(host=DEFAULT_HOST, port=DEFAULT_PORT, max_tokens=DEFAULT_MAX_TOKENS)
    run_argument(parser)
    parser.add_argument("--out", metavar="FILE.html", help="write one self-contained page to this file instead of serving")
    parser.add_argument("--step", type=int, metavar="S", help=f"step shown first (default: {LAST_READABLE})")
    parser.add_argument("--sample", type=at_least(0), metavar="I", help="response shown first (default: the step's first)")
    parser.add_argument("--steps", type=_step_list, metavar="LIST", help="with --out: the steps in the file, e.g. 1,5,10-20 (default: see below)")
    parser.add_argument(
        "--max-tokens", type=at_least(1), metavar="N", help=f"with --out: token rows the file holds at most (default {DEFAULT_MAX_TOKENS})"
    )
    parser.add_argument("--host", help=f"served: address to listen on (default {DEFAULT_HOST}: this machine only)")
    parser.add_argument("--port", type=_port, help=f"served: port (default {DEFAULT_PORT}; 0 picks a free one)")
    tokenizer_argument(parser)
    parallel_arguments(parser)  # with --out: the summary and the check of the file's steps; served, one step a request
    quiet_argument(parser)


def run(args: argparse.Namespace) -> int:
    if args.out is None and (args.steps is not None or args.max_tokens is not None):
        raise UsageError(f"{'--steps' if args.steps is not None else '--max-tokens'} chooses what goes into a file: it needs --out")
    if args.out is not None and (args.host is not None or args.port is not None):
        raise UsageError(f"{'--host' if args.host is not None else '--port'} is for serving: leave out --out to serve the trace")
    if args.out is None and args.ray is not None:
        raise UsageError("--ray reads the steps of a file's page (--out); served, the view reads one step a request")
    trace = open_run(args.run)
    unread = UnreadSteps.of(trace)
    if args.step is not None:
        step = one_step(trace, args.step, lambda step: step_reads(trace, step))[0]
    else:
        step = last_step_that_reads(trace, unread)[0]
    if args.sample is not None:
        start_group(trace, step, args.sample)  # refuses an unknown sample
    decoder = decoder_for(trace, args.tokenizer)
    if not decoder.available:
        print(f"note: {decoder.problem}; tokens are shown as ids", file=sys.stderr)
    if args.out is not None:
        max_tokens = args.max_tokens if args.max_tokens is not None else DEFAULT_MAX_TOKENS
        path = write_page(trace, args.out, step, args.sample, args.steps, max_tokens, decoder, progress_printer(args, "view"), unread, **parallel_options(args))
        emit(str(path))
        return left_out(unread)
    say(unread.lines())  # served, the page says them too; a step read later that does not read is its own error there
    # the page starts at the last step unless told: tell it when that one does not read
    return _serve(trace, decoder, args, step if args.step is not None or step != trace.steps[-1] else None)


def _serve(trace, decoder, args: argparse.Namespace, step: int | None) -> int:

    host = args.host if args.host is not None else DEFAULT_HOST
    server = serve(trace, host, args.port if args.port is not None else DEFAULT_PORT, decoder)
    anchor = "&".join(f"{name}={value}" for name, value in (("step", step), ("sample", args.sample)) if value is not None)
    if not server.check_host:
        print(f"note: serving on {host}: anyone who can reach port {server.port} can read the trace", file=sys.stderr)
    emit(f"serving {trace.path} at {server.url}{'#' + anchor if anchor else ''} (read-only; Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0

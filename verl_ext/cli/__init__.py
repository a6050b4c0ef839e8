"""``verl-ext``: the command line, one module per command.

Each command's module (``verl_ext.cli.<name>``) declares its arguments (``arguments(parser)``) and
runs it (``run(args) -> int``, the exit code); :data:`COMMANDS` names each one with its summary and is
the one place a command is dispatched. A command's module is imported only when that command runs, so
that ``verl-ext --help`` imports none of them.

Exit codes shared by all commands: 0 success, 1 a finding (a failed check, a broken plugin),
2 bad input (a missing or unreadable trace, bad arguments); ``check`` also 3, incomplete (an identity
that applies to the run could not be evaluated here); 130 interrupted (Ctrl-C). Expected errors
print one line to stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple

from verl_ext.errors import UsageError
from verl_ext.options import import_external_modules


class Command(NamedTuple):
    #: the module with ``arguments(parser)`` and ``run(args) -> int``
    module: str
    #: one line, in ``verl-ext --help`` and atop the command's own help
    summary: str


#: name -> its command. Order is the order of ``verl-ext --help``.
COMMANDS: dict[str, Command] = {
    "check": Command("verl_ext.cli.check", "Every identity of docs/definitions.md §8 on every traced step."),
    "show": Command("verl_ext.cli.show", "One sample's per-token table with decoded tokens."),
    "summary": Command("verl_ext.cli.summary", "One line of statistics per traced step."),
    "plot": Command("verl_ext.cli.plot", "PNG figures of a trace in an output directory."),
    "compare": Command(
        "verl_ext.cli.compare", "Re-estimate one traced step with every estimator (no retraining) and show them side by side."
    ),
    "view": Command(
        "verl_ext.cli.view",
        "Look at a run token by token in a browser: one self-contained HTML page (--out), or served from 127.0.0.1.",
    ),
    "sql": Command("verl_ext.cli.sql", "A SQL query over a trace's tables (DuckDB)."),
    "replay": Command(
        "verl_ext.cli.replay", "One recorded step's update run again, offline: as recorded (a proof) or with other settings."
    ),
    "doctor": Command("verl_ext.cli.doctor", "Is verl-ext loaded, is every touch of verl applied, are its estimators registered?"),
    "demo": Command(
        "verl_ext.cli.demo", "Train a tiny model with verl's real PPO trainer on CPU, trace every step, check and show the trace."
    ),
    "study": Command(
        "verl_ext.cli.study", "Run every estimator with every seed on the CPU task through verl's real trainer; compare them."
    ),
    "selftest": Command(
        "verl_ext.cli.selftest",
        "Before a long run: 2 traced steps of mc and of grpo through verl's trainer with your overrides, checked.",
    ),
}


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's error convention: one line on stderr (no usage block), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser(chosen: str | None = None):
    """The parser of ``verl-ext``, with ``(parser, module of the chosen command)``: every command
    listed with its summary, the arguments of ``chosen`` only (its module imported here)."""
    parser = _Parser(prog="verl-ext", description="Token-level inspection and value-based advantage estimators for verl PPO.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    module = None
    for name, command in COMMANDS.items():
        subparser = sub.add_parser(name, help=command.summary, description=command.summary)
        if name == chosen:
            module = importlib.import_module(command.module)
            module.arguments(subparser)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # what follows "--" is a command's overrides, wherever its positionals are (argparse would take an
    # empty list for them at RUN and refuse the rest)
    tail = argv[argv.index("--") + 1 :] if "--" in argv else []
    head = argv[: len(argv) - len(tail) - 1] if "--" in argv else argv
    chosen = head[0] if head and head[0] in COMMANDS else None
    try:  # the command's module is imported here: Ctrl-C while it loads is an interruption too
        parser, module = build_parser(chosen)
    except KeyboardInterrupt:
        print(f"verl-ext{'' if chosen is None else ' ' + chosen}: interrupted", file=sys.stderr)
        return 130
    args = parser.parse_args(head)
    if tail:
        if not hasattr(args, "overrides"):
            parser.error(f"verl-ext {args.command} takes no overrides after --")
        args.overrides = [*args.overrides, *tail]
    try:
        import_external_modules()  # a user's estimators, as in the run: check, compare and the view recompute them
        return int(module.run(args))
    except UsageError as exc:
        print(f"verl-ext {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"verl-ext {args.command}: interrupted", file=sys.stderr)
        return 130

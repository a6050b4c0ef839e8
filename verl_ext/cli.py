"""``verl-ext`` command line: a thin dispatcher.

Each subcommand lives in its own module exposing ``HELP`` (one line), ``add_arguments(parser)``
and ``run(args) -> int`` (the exit code). Modules keep heavy imports inside ``run`` so that
``verl-ext --help`` is instant.

Exit codes shared by all subcommands: 0 success, 1 a finding (a failed check, a broken plugin),
2 bad input (a missing or unreadable trace, bad arguments). Expected errors print one line to
stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from verl_ext.errors import UsageError

SUBCOMMANDS = {
    "doctor": "verl_ext.integration.doctor",
    "check": "verl_ext.inspect.commands.check",
    "show": "verl_ext.inspect.commands.show",
    "summary": "verl_ext.inspect.commands.summary",
    "plot": "verl_ext.inspect.commands.plot",
    "demo": "verl_ext.demo",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-ext", description="Token-level inspection and value-based advantage estimators for verl PPO."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=module.HELP, description=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command])
    try:
        return int(module.run(args))
    except UsageError as exc:
        print(f"verl-ext {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"verl-ext {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

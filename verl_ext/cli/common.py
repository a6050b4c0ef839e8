"""What the commands share that needs no trace: argument types and arguments, output on stdout and
notes on stderr, an output directory checked writable, matplotlib without a screen."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from verl_ext.errors import UsageError

FORMATS = ("text", "csv", "markdown")

#: The step ``show``, ``compare``, ``plot`` and ``view`` take without --step, and why.
LAST_READABLE = (
    "the last traced step, the policy as training left it: what one looks at after a run; when its files do not "
    "read, the last step that does, with a note"
)


def at_least(minimum: int) -> Callable[[str], int]:
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


def run_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "run", metavar="RUN", help="trace directory (verl_ext.trace.dir of the run), local path or fsspec URL"
    )


def format_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--format", choices=FORMATS, default="text", help="output format (default: text)")
    parser.add_argument("--digits", type=at_least(0), default=4, help="decimals shown in text and markdown (default: 4)")


def quiet_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def tokenizer_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tokenizer", metavar="PATH", help="tokenizer directory (default: the run record's tokenizer_path); local files only"
    )


def emit(text: str) -> None:
    """Print to stdout; a reader that went away (``| head -1``) ends the output, not the command."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python would fail again flushing stdout at exit: point it at /dev/null from now on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def say(lines) -> None:
    """Notes for the person at the terminal, on stderr: one line each."""
    for line in lines:
        print(f"note: {line}", file=sys.stderr)


def require_writable(directory: Path, what: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".write-probe"
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise UsageError(f"cannot write {what} to {directory}: {error.strerror or error}") from None


def refuse_unusable_directory(directory, what: str) -> None:
    """Refuse at once, creating nothing, an output directory that cannot be one: a file is there or
    above it, or the nearest folder that exists is not writable (one line, exit 2). What only writing
    shows (a full disk) is the writer's own error."""
    path = Path(directory).absolute()
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        where = "it is" if existing == path else f"{existing} is"
        raise UsageError(f"cannot write {what} to {directory}: {where} a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"cannot write {what} to {directory}: {existing} is not writable")


def headless_matplotlib(what: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        raise UsageError(f"{what} needs matplotlib: pip install 'verl-ext[plot]'") from None

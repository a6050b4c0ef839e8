"""One command at a time in an output folder: a lock taken before anything there is written,
truncated or deleted; and an earlier run in it kept, moved aside, not overwritten.

The lock is ``flock`` on ``FOLDER/.verl-ext.lock``: the kernel releases it when the last process that
holds it ends, however it ends, so a killed run never leaves it stuck. The file says who holds it
(command, process, host, since when) for the one-line refusal a second command gets. A command
hands the lock to the children it starts (the demo's trainer, a study's runs) through an inherited
file descriptor named in :data:`INHERITED`; a child that finds it there holds the lock already.

The trace directory has a lock of its own (:mod:`verl_ext.trace.lease`), which also works on a
filesystem other machines write to.

A command that writes a run into a folder that holds an earlier one (``make demo`` twice) moves the
earlier run's outputs, and whatever the user put inside them, to ``FOLDER/earlier/<UTC time>/``
first (:func:`keep_earlier_run`), holding the lock; verl-ext deletes nothing there. Inside the folder,
not beside it: a rename within one filesystem, which never copies and cannot fail half-way through a
file, possible wherever the folder is writable (its parent may not be, or be another filesystem), and
covered by the folder's lock; the next run writes only its own outputs, never ``earlier/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

from verl_ext.errors import UsageError

LOCK_FILE = ".verl-ext.lock"
#: Where :func:`keep_earlier_run` keeps earlier runs, one folder each, named by their UTC time.
EARLIER = "earlier"
#: ``<fd>:<path>`` of a lock this process inherited from the command that started it.
INHERITED = "VERL_EXT_OUTPUT_LOCK"


@contextlib.contextmanager
def output_lock(folder: str | os.PathLike, command: str) -> Iterator[int | None]:
    """Hold ``folder``'s lock (creating the folder) for the block; yields the descriptor that children
    must inherit (``pass_fds``), or None when this process inherited the lock. UsageError naming the
    holder when another command holds it."""
    path = Path(folder).resolve() / LOCK_FILE
    if _inherited(path):
        yield None
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"{path.parent} is in use by {_holder(path)}; use another output directory, or wait for it to end"
            ) from None
        holder = {"command": command, "pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        os.set_inheritable(fd, True)
        previous = os.environ.get(INHERITED)
        os.environ[INHERITED] = f"{fd}:{path}"
        try:
            yield fd
        finally:
            _restore(previous)
    finally:
        os.close(fd)


def _inherited(path: Path) -> bool:
    """True when the lock this process inherited (:data:`INHERITED`) is ``path``'s, still open here."""
    fd_text, _, inherited_path = os.environ.get(INHERITED, "").partition(":")
    if not fd_text.isdigit() or Path(inherited_path) != path:
        return False
    try:
        opened, named = os.fstat(int(fd_text)), os.stat(path)
    except OSError:
        return False
    return (opened.st_dev, opened.st_ino) == (named.st_dev, named.st_ino)


def _holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text())
        since = time.strftime("%H:%M:%S", time.localtime(holder["since"]))
        return f"`{holder['command']}` (process {holder['pid']} on {holder['host']}, since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another verl-ext command"


def _restore(previous: str | None) -> None:
    if previous is None:
        os.environ.pop(INHERITED, None)
    else:
        os.environ[INHERITED] = previous



def keep_earlier_run(folder: str | os.PathLike, outputs: tuple[str, ...], label: str) -> Path | None:
    """Move the outputs of an earlier run in ``folder`` (the names of ``outputs`` that exist there, with
    everything inside them) to a new ``folder/earlier/<UTC time>/``, and say so in one line after
    ``label``; the place, or None when there was nothing to keep. Call it holding ``folder``'s lock,
    before the run writes anything. Each output is one ``rename``, never a copy; a SIGINT or SIGTERM
    during the move is acted on once it is done (in the main thread: elsewhere Python runs no signal
    handler anyway); a process killed outright leaves each output in one place or the other, and the
    next run moves the rest. UsageError when the move cannot be done (nothing lost: what moved is named)."""
    folder = Path(folder)
    present = [name for name in outputs if os.path.lexists(folder / name)]
    if not present:
        return None
    moved: list[str] = []
    target = None
    try:
        target = _new_folder(folder / EARLIER, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
        with _signals_deferred():
            for name in present:
                os.rename(folder / name, target / name)
                moved.append(name)
    except OSError as error:
        done = f"; {', '.join(moved)} moved to {target} already" if moved else ""
        raise UsageError(f"cannot move the earlier run in {folder} aside: {error.strerror or error}{done}") from None
    shown = ", ".join(name + ("/" if (target / name).is_dir() else "") for name in present)
    print(f"{label} the earlier run in this folder ({shown}) moved to {target}", flush=True)
    return target


def _new_folder(parent: Path, name: str) -> Path:
    """A new folder ``parent/name`` (``name-2``, ``-3``, … when taken: two runs in one second)."""
    parent.mkdir(exist_ok=True)
    for attempt in range(1, 1000):
        path = parent / (name if attempt == 1 else f"{name}-{attempt}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent / name}: taken")


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """For the block, SIGINT and SIGTERM are noted, not acted on; after it, each is raised again for the
    handler that was there before (Ctrl-C's KeyboardInterrupt then comes after the block)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)

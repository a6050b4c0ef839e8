"""One command at a time in an output folder: a lock taken before anything there is written,
truncated or deleted.

The lock is ``flock`` on ``FOLDER/.verl-ext.lock``: the kernel releases it when the last process that
holds it ends, however it ends, so a killed run never leaves it stuck. The file says who holds it
(command, process, host, since when) for the one-line refusal a second command gets. A command
hands the lock to the children it starts (the demo's trainer, a study's runs) through an inherited
file descriptor named in :data:`INHERITED`; a child that finds it there holds the lock already.

The trace directory has a lock of its own (:mod:`verl_ext.trace.lease`), which also works on a
filesystem other machines write to.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from verl_ext.errors import UsageError

LOCK_FILE = ".verl-ext.lock"
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


"""One writer per trace directory: a lease, ``TRACE/_writer.json``, that a killed writer cannot leave stuck.

The writer publishes the lease when it opens the directory (which host, which process, since when)
and renews it every :data:`RENEW_SECONDS` from its background thread; closing removes it. Another
writer that finds a live lease refuses the directory with a one-line error naming the holder. A
lease is dead when it was not renewed for :data:`EXPIRE_SECONDS`, or, on the same host, when its
process no longer exists (a run killed and resumed at once on the same machine need not wait).
Two writers starting in the same instant may both publish; each renewal re-reads the lease, so the
one whose lease was replaced learns within :data:`RENEW_SECONDS` and stops writing.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass

import pyarrow.fs as pafs

from verl_ext.errors import UsageError
from verl_ext.trace import storage

LEASE_FILE = "_writer.json"
RENEW_SECONDS = 10.0
EXPIRE_SECONDS = 60.0


@dataclass(frozen=True)
class Lease:
    id: str
    host: str
    pid: int
    started: float  # unix time
    renewed: float

    def describe(self, now: float) -> str:
        return f"process {self.pid} on {self.host} (since {time.strftime('%H:%M:%S', time.localtime(self.started))}, renewed {now - self.renewed:.0f} s ago)"

    def alive(self, now: float) -> bool:
        if now - self.renewed > EXPIRE_SECONDS:
            return False
        if self.host == socket.gethostname():
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:  # exists, owned by someone else
                return True
        return True


def read(fs: pafs.FileSystem, root: str) -> Lease | None:
    """The lease in the directory, or None (no lease, or one that cannot be read: treated as absent)."""
    path = storage.join(root, LEASE_FILE)
    try:
        if not storage.exists(fs, path):
            return None
        return Lease(**json.loads(storage.read_bytes(fs, path)))
    except (OSError, ValueError, TypeError):
        return None


def refuse_if_held(fs: pafs.FileSystem, root: str, shown: str) -> None:
    """UsageError when a live writer holds the directory."""
    now = time.time()
    holder = read(fs, root)
    if holder is not None and holder.alive(now):
        raise UsageError(
            f"trace dir {shown} is being written by {holder.describe(now)}; one writer at a time: use another "
            f"directory, or if that run is gone wait {EXPIRE_SECONDS:.0f} s or delete {shown}/{LEASE_FILE}"
        )


class Holder:
    """This process' lease of a trace directory."""

    def __init__(self, fs: pafs.FileSystem, root: str, shown: str):
        self._fs, self._root, self._shown = fs, root, shown
        refuse_if_held(fs, root, shown)
        now = time.time()
        self.lease = Lease(uuid.uuid4().hex, socket.gethostname(), os.getpid(), now, now)
        self._publish()

    def _publish(self) -> None:
        storage.publish_bytes(self._fs, self._root, LEASE_FILE, json.dumps(asdict(self.lease)).encode())

    def renew(self) -> None:
        """Renew the lease; OSError when another writer replaced it (this one must stop writing)."""
        current = read(self._fs, self._root)
        if current is not None and current.id != self.lease.id:
            raise OSError(f"another writer took over the trace directory: {current.describe(time.time())}")
        self.lease = Lease(self.lease.id, self.lease.host, self.lease.pid, self.lease.started, time.time())
        self._publish()

    def release(self) -> None:
        current = read(self._fs, self._root)
        if current is None or current.id == self.lease.id:
            storage.remove_quietly(self._fs, storage.join(self._root, LEASE_FILE))

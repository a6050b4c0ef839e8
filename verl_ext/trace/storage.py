"""Where a trace lives: one filesystem API for local paths and fsspec URLs, and atomic publishing.

Every file operation of the trace goes through a ``pyarrow.fs.FileSystem``: local paths (and
``file://`` URLs) get pyarrow's native ``LocalFileSystem``; any other fsspec URL (``memory://``,
``s3://``, ``gs://`` …) gets its fsspec filesystem wrapped in ``PyFileSystem(FSSpecHandler(...))``.

Atomic publish: a file is written under ``_tmp/`` in the trace directory, then moved to its final
name. Guarantees by filesystem:

* local (POSIX): the move is ``rename(2)``, which replaces an existing file atomically. A reader
  sees the old file or the new one, never a partial one, and a process killed at any point leaves
  every published file intact (at worst a stale file in ``_tmp/``). There is no fsync, so this
  holds against process crashes, not against a power loss of the machine.
* object stores (s3, gcs, …) through fsspec: the move is a server-side copy then a delete. A single
  object appears whole or not at all, so a reader still never sees a half-written file; but a
  replaced step is briefly absent between the copy and the delete on some stores, and nothing spans
  several objects (a step's token file, its prompt file and the run record appear one by one).
* ``memory://`` and other in-process stores: copy then delete within the process.
"""

from __future__ import annotations

import posixpath
import uuid
from typing import Callable

import fsspec
import pyarrow as pa
import pyarrow.fs as pafs
from fsspec.implementations.arrow import ArrowFSWrapper
from fsspec.implementations.local import LocalFileSystem

from verl_ext.errors import UsageError, one_line
from verl_ext.trace.schema import TMP_DIR


def resolve(path: str, filesystem=None) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or fsspec URL.

    ``filesystem`` may be given as a ``pyarrow.fs.FileSystem`` or an fsspec filesystem; ``path``
    is then a path inside it.
    """
    if isinstance(filesystem, pafs.FileSystem):
        return filesystem, path.rstrip("/") or "/"
    if filesystem is None:
        filesystem, path = fsspec.core.url_to_fs(path)
    else:
        path = filesystem._strip_protocol(path)
    return _as_arrow(filesystem), path.rstrip("/") or "/"


def _as_arrow(filesystem) -> pafs.FileSystem:
    if type(filesystem) is LocalFileSystem:  # a subclass may change behaviour: keep it
        return pafs.LocalFileSystem()
    if isinstance(filesystem, ArrowFSWrapper):
        return filesystem.fs
    return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))


def join(root: str, relative: str) -> str:
    return posixpath.join(root, relative)


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes:
    with fs.open_input_stream(path, compression=None) as stream:
        return stream.readall()


def publish(fs: pafs.FileSystem, root: str, relative: str, write: Callable[[pa.NativeFile], None]) -> None:
    """Write ``root/relative`` atomically: ``write(stream)`` into a temporary file, then move it.

    On failure the temporary file is removed (best effort) and the error propagates; a file
    already at ``root/relative`` is untouched.
    """
    final = join(root, relative)
    temporary = join(root, f"{TMP_DIR}/{relative.replace('/', '~')}.{uuid.uuid4().hex}.tmp")
    try:
        with fs.open_output_stream(temporary, compression=None) as stream:
            write(stream)
        fs.create_dir(posixpath.dirname(final), recursive=True)
        fs.move(temporary, final)
    except BaseException:
        remove_quietly(fs, temporary)
        raise


def publish_bytes(fs: pafs.FileSystem, root: str, relative: str, data: bytes) -> None:
    publish(fs, root, relative, lambda stream: stream.write(data))


def prepare_directory(fs: pafs.FileSystem, root: str) -> None:
    """Create the trace directory and its ``_tmp/``, clear stale temporaries, prove that files can be
    published in it. Raises ``OSError`` (or whatever the filesystem raises) when it cannot.

    Temporaries left by a writer that was killed are removed: call this only while holding the
    directory's lease (:mod:`verl_ext.trace.lease`).
    """
    fs.create_dir(join(root, TMP_DIR), recursive=True)
    fs.delete_dir_contents(join(root, TMP_DIR), missing_dir_ok=True)
    probe = f"{TMP_DIR}/.write-probe-{uuid.uuid4().hex}"
    publish_bytes(fs, root, probe, b"verl-ext write probe\n")
    fs.delete_file(join(root, probe))


def remove_empty_tmp(fs: pafs.FileSystem, root: str) -> None:
    """Remove ``_tmp/`` when nothing is left in it (a finished trace holds only what readers need)."""
    tmp = join(root, TMP_DIR)
    try:
        if not fs.get_file_info(pafs.FileSelector(tmp, allow_not_found=True)):
            fs.delete_dir(tmp)
    except Exception:  # noqa: BLE001 - an untidy directory is not worth an error
        pass


def check_writable(directory: str) -> None:
    """That the trace directory can be created and written, leaving nothing behind (no directory this
    created, no file): what the driver checks before training. A one-line UsageError when it can't."""
    try:
        fs, root = resolve(directory)
        created = []
        path = root
        while path and fs.get_file_info(path).type == pafs.FileType.NotFound:
            created.append(path)
            parent = posixpath.dirname(path)
            if parent == path:
                break
            path = parent
        try:
            fs.create_dir(root, recursive=True)
            probe = join(root, f".verl-ext-probe-{uuid.uuid4().hex}")
            with fs.open_output_stream(probe, compression=None) as stream:
                stream.write(b"verl-ext write probe\n")
            fs.delete_file(probe)
        finally:
            for path in created:  # deepest first
                try:
                    fs.delete_dir(path)
                except Exception:  # noqa: BLE001
                    pass
    except Exception as error:  # noqa: BLE001 - whatever the filesystem raises, the cause is the dir
        raise UsageError(f"trace dir {directory} is not writable: {one_line(error)}") from None


def remove_quietly(fs: pafs.FileSystem, path: str) -> None:
    try:
        fs.delete_file(path)
    except Exception:  # noqa: BLE001 - the original error is the one worth reporting
        pass

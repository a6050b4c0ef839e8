"""The run record ``_run.json``: read and check it, merge a resumed run into it, serialize it.

Its keys are documented in :mod:`verl_ext.trace.schema`.
"""

from __future__ import annotations

import json
import warnings

import pyarrow.fs as pafs

from verl_ext.errors import TraceError
from verl_ext.trace import storage
from verl_ext.trace.schema import RUN_RECORD, SCHEMA_VERSION

#: Schema versions this code reads.
READABLE_SCHEMA_VERSIONS = (SCHEMA_VERSION,)


def read(fs: pafs.FileSystem, root: str, shown_path: str) -> dict | None:
    """The run record at ``root``, or None when there is none; TraceError when it is unreadable
    or of a schema version this code does not know. ``shown_path`` names the trace in errors."""
    path = storage.join(root, RUN_RECORD)
    if not storage.exists(fs, path):
        return None
    try:
        record = json.loads(storage.read_bytes(fs, path))
    except (OSError, ValueError) as error:
        raise TraceError(f"{shown_path}: {RUN_RECORD} is not readable JSON ({storage.one_line(error)})") from None
    if not isinstance(record, dict) or not isinstance(record.get("steps", {}), dict):
        raise TraceError(f"{shown_path}: {RUN_RECORD} is not a verl-ext run record")
    version = record.get("schema_version")
    if version not in READABLE_SCHEMA_VERSIONS:
        raise TraceError(
            f"{shown_path}: trace schema version {version!r} is not supported by this verl-ext "
            f"(it reads {', '.join(map(str, READABLE_SCHEMA_VERSIONS))})"
        )
    record.setdefault("steps", {})
    return record


def merge(existing: dict | None, new: dict, shown_path: str) -> dict:
    """The record a writer starts from: ``new`` (the run now starting) with the step entries of
    ``existing`` (a run traced earlier into the same directory, e.g. before a resume).

    Warns when the algorithm settings changed, since earlier steps were computed with the old ones.
    """
    merged = {**new, "schema_version": SCHEMA_VERSION, "steps": dict(existing["steps"]) if existing else {}}
    if existing and existing.get("algorithm") != new.get("algorithm"):
        old, now = existing.get("algorithm") or {}, new.get("algorithm") or {}
        changed = sorted(k for k in set(old) | set(now) if old.get(k) != now.get(k))
        warnings.warn(
            f"trace dir {shown_path}: algorithm settings differ from the run traced there before "
            f"({', '.join(f'{k}: {old.get(k)!r} -> {now.get(k)!r}' for k in changed)}); "
            "steps already in the trace were computed with the old settings",
            stacklevel=3,
        )
    return merged


def dumps(record: dict) -> bytes:
    """JSON bytes, steps in numeric order; TypeError/ValueError if something is not JSON data."""
    steps = dict(sorted(record["steps"].items(), key=lambda item: int(item[0])))
    return json.dumps({**record, "steps": steps}, indent=1).encode()


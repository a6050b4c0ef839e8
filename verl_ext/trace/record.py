"""Reading ``_run.json`` from a trace directory, and starting a resumed run's record from it."""

from __future__ import annotations

import dataclasses
import warnings

import pyarrow.fs as pafs

from verl_ext.errors import TraceError, one_line
from verl_ext.trace import storage
from verl_ext.trace.schema import RUN_RECORD, SCHEMA_VERSION, RunRecord


def read(fs: pafs.FileSystem, root: str, shown_path: str) -> RunRecord | None:
    """The run record at ``root``, or None when there is none; TraceError when it is unreadable
    or of a schema version this code does not know. ``shown_path`` names the trace in errors."""
    path = storage.join(root, RUN_RECORD)
    if not storage.exists(fs, path):
        return None
    try:
        raw = storage.read_bytes(fs, path)
    except OSError as error:
        raise TraceError(f"{shown_path}: {RUN_RECORD} is not readable ({one_line(error)})") from None
    return RunRecord.from_json(raw, shown_path)


def merge(existing: RunRecord | None, new: RunRecord, shown_path: str, schema_version: int = SCHEMA_VERSION) -> RunRecord:
    """The record a writer starts from: ``new`` (the run now starting) with the step entries of
    ``existing`` (a run traced earlier into the same directory, e.g. before a resume), of the
    ``schema_version`` the writer writes (that of the layout it writes in).

    Warns when the algorithm settings changed, since earlier steps were computed with the old ones.
    """
    merged = dataclasses.replace(new, schema_version=schema_version, steps=dict(existing.steps) if existing else {})
    if existing and existing.algorithm != new.algorithm:
        old, now = existing.algorithm, new.algorithm
        changed = sorted(k for k in set(old) | set(now) if old.get(k) != now.get(k))
        warnings.warn(
            f"trace dir {shown_path}: algorithm settings differ from the run traced there before "
            f"({', '.join(f'{k}: {old.get(k)!r} -> {now.get(k)!r}' for k in changed)}); "
            "steps already in the trace were computed with the old settings",
            stacklevel=3,
        )
    return merged

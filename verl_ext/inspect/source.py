"""Every inspection function takes an open trace or a path to one."""

from __future__ import annotations

import os


def as_trace(trace_or_path):
    """``trace_or_path`` if it is an open trace, else the trace opened at that path."""
    if isinstance(trace_or_path, (str, os.PathLike)):
        from verl_ext.trace.reader import open_trace

        return open_trace(os.fspath(trace_or_path))
    return trace_or_path

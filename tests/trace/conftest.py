"""Fixtures of the trace tests: fresh in-memory trace locations."""

from __future__ import annotations

import uuid

import fsspec
import pytest

from tests.trace.helpers import HookedMemoryFileSystem


@pytest.fixture
def memory_url():
    """A fresh memory:// trace location, removed afterwards."""
    url = f"memory://trace-tests/{uuid.uuid4().hex}"
    yield url
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


@pytest.fixture
def hooked_url():
    """A hookedmem:// location; set ``HookedMemoryFileSystem.on_write`` to inject faults."""
    url = f"{HookedMemoryFileSystem.protocol}://{uuid.uuid4().hex}"
    yield url
    HookedMemoryFileSystem.on_write = None
    HookedMemoryFileSystem.store.clear()
    HookedMemoryFileSystem.pseudo_dirs[:] = [""]

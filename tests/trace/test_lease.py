"""lease.py: one writer per trace directory. A second writer is refused in one line naming the holder
(so is the driver's check of the directory before Ray starts), a writer killed with -9 leaves a lease
that is dead at once, and a writer whose lease was taken over stops writing."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trace.helpers import make_capture, run_record
from verl_ext.errors import UsageError
from verl_ext.integration.validation import check_trace_dir_writable
from verl_ext.options import TraceOptions
from verl_ext.trace import lease
from verl_ext.trace.reader import open_trace
from verl_ext.trace.writer import TraceWriter

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_writer_fails_clearly_and_a_killed_one_leaves_no_lock(tmp_path):
    directory = str(tmp_path / "trace")
    first = TraceWriter(TraceOptions(dir=directory), run_record())
    first.submit(make_capture(1))
    with pytest.raises(UsageError, match=rf"trace dir {directory} is being written by process {os.getpid()} on "):
        TraceWriter(TraceOptions(dir=directory), run_record())
    with pytest.raises(ValueError, match="is being written by process"):  # the driver says so before Ray starts
        check_trace_dir_writable(directory)
    first.submit(make_capture(2))
    first.close()
    assert open_trace(directory).steps == [1, 2] and sorted(open_trace(directory).record.steps) == ["1", "2"]
    assert not (tmp_path / "trace" / lease.LEASE_FILE).exists()

    # a writer killed with -9 leaves its lease; its process is gone, so the lease is dead at once
    child = subprocess.run(
        [sys.executable, "-c",
         "import os, sys; sys.path.insert(0, %r)\n"
         "from tests.trace.helpers import make_capture, run_record\n"
         "from verl_ext.options import TraceOptions\nfrom verl_ext.trace.writer import TraceWriter\n"
         "w = TraceWriter(TraceOptions(dir=%r), run_record()); w.submit(make_capture(3)); w.flush()\n"
         "os.kill(os.getpid(), 9)" % (str(ROOT), directory)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -9 and (tmp_path / "trace" / lease.LEASE_FILE).exists()
    with TraceWriter(TraceOptions(dir=directory), run_record()) as writer:
        writer.submit(make_capture(4))
    assert open_trace(directory).steps == [1, 2, 3, 4]


def test_a_writer_whose_lease_was_taken_over_stops_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(lease, "RENEW_SECONDS", 0.05)
    directory = str(tmp_path / "trace")
    writer = TraceWriter(TraceOptions(dir=directory), run_record())
    other = '{"id": "other", "host": "elsewhere", "pid": 1, "started": 0, "renewed": %f}' % time.time()
    (tmp_path / "trace" / lease.LEASE_FILE).write_text(other)
    time.sleep(0.3)  # the writer renews its lease and finds another one
    with pytest.warns(RuntimeWarning, match="another writer took over the trace directory: process 1 on elsewhere"):
        writer.submit(make_capture(1))
        writer.close()
    assert open_trace(directory).steps == []  # it wrote nothing more
    assert (tmp_path / "trace" / lease.LEASE_FILE).read_text() == other  # and left the other's lease alone

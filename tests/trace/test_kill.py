"""A writer process killed with SIGKILL in the middle of a write, and one that exits without close().

The child traces steps 1, 2, 3 through a local filesystem whose write of one chosen file stops
half-way (after its first bytes reach the disk) and waits; the test kills it there. What must hold:
earlier steps are intact for every reader, no half-written step is visible, and a writer resuming
into the directory completes it without duplicates.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import duckdb
import pandas
import polars
import pyarrow.dataset as ds

from tests.support.forkserver import real_python
from tests.trace.helpers import make_capture, reference_rows, run_record
from verl_ext.options import TraceOptions
from verl_ext.trace.reader import open_trace
from verl_ext.trace.writer import TraceWriter

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import sys, time
import fsspec
from fsspec.implementations.local import LocalFileSystem
from tests.trace.helpers import make_capture, run_record
from verl_ext.options import TraceOptions
from verl_ext.trace.writer import TraceWriter

directory, stall_at, occurrence, close = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "close"
seen = 0


class StallingLocalFileSystem(LocalFileSystem):
    protocol = "stallfile"

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("stallfile://"))

    def _open(self, path, mode="rb", **kwargs):
        global seen
        file = super()._open(path, mode, **kwargs)
        if "w" in mode and stall_at.replace("/", "~") in path:
            seen += 1
            if seen == occurrence:
                write = file.write

                def stalling_write(data):
                    written = write(data)
                    file.flush()
                    print("MID-WRITE", path, flush=True)
                    time.sleep(600)
                    return written

                file.write = stalling_write
        return file


fsspec.register_implementation("stallfile", StallingLocalFileSystem, clobber=True)
writer = TraceWriter(TraceOptions(dir="stallfile://" + directory), run_record())
for step in (1, 2, 3):
    writer.submit(make_capture(step, seed=step))
if close:
    writer.close()
print("DONE", flush=True)
"""


def run_child(directory: Path, stall_at: str, occurrence: int, close: bool) -> str:
    """Start the child; kill it at its first line if that says MID-WRITE. Returns that line."""
    with subprocess.Popen(  # a real interpreter: killed at once (tests/support/forkserver.py, real_python)
        [real_python(), "-c", CHILD, str(directory), stall_at, str(occurrence), "close" if close else "no-close"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            ready, _, _ = select.select([child.stdout], [], [], 60)
            line = child.stdout.readline() if ready else ""
            if line.startswith("MID-WRITE"):
                os.kill(child.pid, signal.SIGKILL)
            assert child.wait(60) in (0, -signal.SIGKILL), child.stderr.read()
            return line
        finally:
            if child.poll() is None:
                child.kill()


def steps_seen_by_every_reader(directory: Path) -> dict[str, dict[int, int]]:
    """{reader: {step: rows}} from the four standard readers and open_trace."""

    def counts(steps) -> dict[int, int]:
        result: dict[int, int] = {}
        for step in steps:
            result[int(step)] = result.get(int(step), 0) + 1
        return result

    glob = f"{directory}/step-*/*.parquet"
    return {
        "pyarrow": counts(ds.dataset(directory, format="parquet").to_table()["step"].to_pylist()),
        "pandas": counts(pandas.read_parquet(directory)["step"]),
        "polars": counts(polars.scan_parquet(glob).collect()["step"]),
        "duckdb": counts(v for (v,) in duckdb.sql(f"select step from read_parquet('{glob}')").fetchall()),
        "open_trace": {step: table.num_rows for step, table in open_trace(str(directory)).iter_steps(["step"])},
    }


def rows(step: int) -> int:
    return len(reference_rows(make_capture(step, seed=step)))


def resume_and_finish(directory: Path) -> None:
    """A new writer (the resumed run) re-traces step 3 and traces step 4."""
    with TraceWriter(TraceOptions(dir=str(directory)), run_record()) as writer:
        writer.submit(make_capture(3, seed=3))
        writer.submit(make_capture(4, seed=4))
    expected = {step: rows(step) for step in (1, 2, 3, 4)}
    assert all(seen == expected for seen in steps_seen_by_every_reader(directory).values())
    assert not (directory / "_tmp").exists()  # nothing left in it, so a clean close removed it
    assert open_trace(str(directory)).read_step(3).drop_columns(["step"]).to_pylist() == reference_rows(make_capture(3, seed=3))


def test_killed_while_writing_a_token_file(tmp_path):
    line = run_child(tmp_path, "step-3/part-0.parquet", occurrence=1, close=True)
    assert line.startswith("MID-WRITE")
    partial = [path for path in (tmp_path / "_tmp").iterdir() if "step-3~part-0.parquet" in path.name]
    assert len(partial) == 1 and partial[0].stat().st_size > 0  # it really died mid-write

    expected = {1: rows(1), 2: rows(2)}
    assert steps_seen_by_every_reader(tmp_path) == dict.fromkeys(["pyarrow", "pandas", "polars", "duckdb", "open_trace"], expected)
    trace = open_trace(str(tmp_path))
    assert sorted(trace.record.steps) == ["1", "2"]
    assert trace.prompts(2).num_rows == len(make_capture().uid)
    resume_and_finish(tmp_path)


def test_killed_while_writing_the_run_record(tmp_path):
    # _run.json is written at start, then after each step: the 4th write is the one after step 3.
    line = run_child(tmp_path, "_run.json", occurrence=4, close=True)
    assert line.startswith("MID-WRITE")
    record = json.loads((tmp_path / "_run.json").read_text())  # the previous version, whole
    assert sorted(record["steps"]) == ["1", "2"]
    trace = open_trace(str(tmp_path))
    assert trace.steps == [1, 2, 3]  # step 3 was published before its record entry
    assert trace.step_record(3).rows == rows(3)
    resume_and_finish(tmp_path)


def test_exit_without_close_still_writes_everything(tmp_path):
    line = run_child(tmp_path, "never-matches", occurrence=1, close=False)
    assert line.startswith("DONE")
    assert steps_seen_by_every_reader(tmp_path)["open_trace"] == {step: rows(step) for step in (1, 2, 3)}

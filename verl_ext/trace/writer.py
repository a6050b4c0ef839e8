"""The background trace writer: a bounded queue between the training thread and one writer thread.

``submit`` (training thread) copies what the step needs (:func:`capture.take_snapshot`) and queues
the copy; the writer thread builds the Arrow tables and publishes, for each step, in this order:

1. ``_prompts/step-<n>.parquet``
2. ``step-<n>/part-0.parquet``: publishing it is what makes the step visible to every reader;
   its footer holds the step entry (and a write id shared with the prompt file)
3. ``_run.json`` with the step entry added

and, when the step's updates have run, ``_critic_update/step-<n>/part-0.parquet`` and
``_actor_update/step-<n>/part-0.parquet`` (each followed by ``_run.json`` with its entry added).
A writer resuming into a trace of format 1 or 2 writes these files in that trace's layout
(``step=<n>``, format 2) and says so once, so that one trace never mixes layouts (schema.py).

The run record's ``finished`` stays as the run started it (False for a training run) until
:meth:`TraceWriter.finish`, which the trainer's ``fit()`` wrapper calls once ``fit()`` returned after its
last step: a run that stopped in any other way (killed, interrupted, an error) leaves a record that says
it did not finish.

Every file is written under ``_tmp/`` and moved into place (:mod:`storage` says what that
guarantees per filesystem), so a reader never sees a half-written file, a re-traced step replaces
the old files (one file per step, never duplicates), and a failed or killed write leaves every
file published before it intact. If a write of a step that already exists is cut between 1 and
2, the old token file stays next to the new prompt file; the write ids then differ and the
reader's ``prompts(step)`` refuses the pair instead of mixing runs.

Failures (of a write, or of a capture that cannot be copied) are collected and reported on the
training thread at the next ``submit``/``flush``/``close``: as one warning per failed step
(``on_error="warn"``; training goes on and the step is missing from the trace, unless the message
says that only ``_run.json`` was not updated), or as a :class:`TraceError` (``on_error="raise"``;
the step being submitted is then not traced). One writer per trace directory at a time: the
writer holds a lease on the directory (:mod:`lease`) and refuses a directory another one holds;
closing releases it and removes the empty ``_tmp/``.

Memory: at most ``queue_size`` snapshots wait in the queue, one more is being turned into tables
and one more may be in ``submit`` waiting for room. A snapshot of N samples of length T takes
N × (41 T + 5 P) bytes (9 float32 columns, int32 ids, bool mask; P prompt positions); this memory
is recycled from step to step (:class:`~verl_ext.trace.snapshot_memory.SnapshotMemory`), so the writer keeps up to
``queue_size + 2`` such blocks, fewer when steps never pile up. Add one step's Arrow tables and
Parquet encoding buffers (about 100 MB for 10⁶ rows) while it is written.
"""

from __future__ import annotations

import atexit
import os
import posixpath
import queue
import threading
import time
import traceback
import warnings

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from verl_ext.errors import TraceError, UsageError, one_line
from verl_ext.options import TraceOptions
from verl_ext.trace import lease, record, storage
from verl_ext.trace.capture import StepCapture, StepSnapshot, take_snapshot
from verl_ext.trace.snapshot_memory import SnapshotMemory
from verl_ext.trace.step_files import StepFiles
from verl_ext.trace.update_files import UpdateCapture, UpdateFiles
from verl_ext.trace.schema import (
    FLOAT_COLUMN_NAMES,
    HIVE_LAYOUT,
    LAYOUT,
    RUN_RECORD,
    STEP_FILE,
    TMP_DIR,
    Layout,
    RunRecord,
    layout_of,
)

#: Parquet encoding of the token file, chosen by benchmarks/bench_trace.py: float columns as
#: byte-stream-split (no dictionary, which costs a hash per value and rarely pays on floats) then
#: zstd level 1; dictionaries only where values repeat. Row groups of 128 Ki rows let readers
#: skip by ``sample`` statistics and read in parallel.
TOKEN_PARQUET_OPTIONS = {
    "compression": "zstd",
    "compression_level": 1,
    "use_dictionary": ["step", "uid", "token_id", "role"],
    "use_byte_stream_split": list(FLOAT_COLUMN_NAMES),
    "row_group_size": 128 * 1024,
}
PROMPT_PARQUET_OPTIONS = {"compression": "zstd", "compression_level": 1}
UPDATE_PARQUET_OPTIONS = {
    "compression": "zstd",
    "compression_level": 1,
    "use_dictionary": ["step", "clip"],
    "row_group_size": 128 * 1024,
}

_STOP = object()
#: Queued by :meth:`TraceWriter.finish`: the writer thread marks the run record finished, after every
#: step queued before it is written.
_FINISHED = object()


class TraceWriter:
    """Writes submitted steps to ``options.dir`` on a background thread.

    Construct it before training starts: the constructor raises :class:`UsageError` when the
    directory cannot be written (naming it and the reason), the options are invalid, or the run
    record is not JSON data; it then creates the directory, writes ``_run.json`` (``run_record``
    plus ``schema_version``; on resume the ``steps`` entries already there are kept) and starts
    the writer thread. The caller decides which steps to trace (``TraceOptions.traces_step``).
    Usable as a context manager; ``close()`` also runs at interpreter exit if it was not called.
    """

    def __init__(self, options: TraceOptions, run_record: RunRecord):
        if not options.enabled:
            raise UsageError("verl_ext.trace.dir is not set, so there is nothing to write to")
        self._options = options
        try:
            run_record.to_json()
        except (TypeError, ValueError) as error:
            raise UsageError(f"the run record is not JSON data: {error}") from None
        try:
            self._fs, self._root = storage.resolve(options.dir)
            self._fs.create_dir(storage.join(self._root, TMP_DIR), recursive=True)
            self._lease = lease.Holder(self._fs, self._root, options.dir)  # before touching anything else
        except UsageError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever the filesystem raises, the cause is the dir
            raise UsageError(f"trace dir {options.dir} is not writable: {one_line(error)}") from None
        try:
            storage.prepare_directory(self._fs, self._root)
            existing = record.read(self._fs, self._root, options.dir)
            self._layout = _layout_to_write(self._fs, self._root, options.dir, existing)
            self._record = record.merge(existing, run_record, options.dir, self._layout.schema_version)
            self._write_record()
        except Exception as error:  # noqa: BLE001
            self._lease.release()
            if isinstance(error, UsageError):
                raise
            raise UsageError(f"trace dir {options.dir} is not writable: {one_line(error)}") from None

        self._queue: queue.Queue = queue.Queue(maxsize=options.queue_size)
        self._memory = SnapshotMemory()
        self._failures: list[tuple[int | None, BaseException]] = []
        self._failures_lock = threading.Lock()
        self._closed = False
        self._lost: BaseException | None = None  # why this writer lost its lease, once it has
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._work, name="verl-ext-trace-writer", daemon=True)
        self._thread.start()
        atexit.register(self._close_at_exit)

    # ------------------------------------------------------------------ training thread

    def submit(self, capture: StepCapture) -> None:
        """Queue one step. Copies what it needs before returning (the trainer may then reuse its
        tensors); blocks only while the queue is full. Reports earlier failures first."""
        if self._closed:
            raise UsageError("TraceWriter.submit() called after close()")
        self._report_failures(may_raise=True)
        try:
            snapshot = take_snapshot(capture, self._options.max_samples_per_step, self._memory)
        except Exception as error:  # noqa: BLE001 - a bad capture must not stop training either
            self._record_failure(getattr(capture, "step", None), error)
            self._report_failures(may_raise=True)
            return
        self._queue.put(snapshot)

    def submit_update(self, capture: UpdateCapture) -> None:
        """Queue one update table of a step (its data is already host memory: nothing is copied)."""
        if self._closed:
            raise UsageError("TraceWriter.submit_update() called after close()")
        self._report_failures(may_raise=True)
        self._queue.put(capture)

    def finish(self) -> None:
        """Say in the run record that the run finished: call once the trainer's ``fit()`` returned after its
        last step. Written after the steps already submitted; a failure to write it is reported like a
        step's."""
        if self._closed:
            raise UsageError("TraceWriter.finish() called after close()")
        self._queue.put(_FINISHED)

    def flush(self) -> None:
        """Wait until every submitted step is written (or has failed), then report failures."""
        self._queue.join()
        self._report_failures(may_raise=True)

    def close(self) -> None:
        """Write what is queued, stop the thread; idempotent. With ``on_error="raise"``, raises the
        first failure not reported yet."""
        self._stop()
        self._report_failures(may_raise=True)

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:  # never hide the exception that is already propagating
            self._close_at_exit()

    def _close_at_exit(self) -> None:
        if os.getpid() != self._pid:  # a forked child inherits the handler, not the thread
            return
        self._stop()
        self._report_failures(may_raise=False)

    def _stop(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join()
        atexit.unregister(self._close_at_exit)
        self._lease.release()
        storage.remove_empty_tmp(self._fs, self._root)

    def _report_failures(self, *, may_raise: bool) -> None:
        with self._failures_lock:
            failures, self._failures = self._failures, []
        if not failures:
            return
        if may_raise and self._options.on_error == "raise":
            (step, error), others = failures[0], [step for step, _ in failures[1:]]
            more = f" (steps {', '.join(map(str, others))} failed too)" if others else ""
            what = f"writing step {step} of the trace" if step is not None else "writing the trace"  # its run record, its lease
            raise TraceError(f"{what} to {self._options.dir} failed: {one_line(error)}{more}") from error
        consequence = "training goes on" if self._options.on_error == "warn" else "reported when the trace closed"
        for step, error in failures:
            what = f"writing step {step}" if step is not None else "the trace"
            warnings.warn(
                f"verl-ext trace: {what} to {self._options.dir} failed: {one_line(error)}; {consequence}",
                RuntimeWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------------ writer thread

    def _work(self) -> None:
        renew_at = time.monotonic() + lease.RENEW_SECONDS
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, renew_at - time.monotonic()))
            except queue.Empty:
                item = None
            if time.monotonic() >= renew_at:  # keep the directory ours (lease.py)
                renew_at = time.monotonic() + lease.RENEW_SECONDS
                try:
                    self._lease.renew()
                except Exception as error:  # noqa: BLE001 - another writer, or the filesystem went away
                    self._lost = error
                    self._record_failure(None, error)
            if item is None:
                continue
            if item is _STOP:
                self._queue.task_done()
                return
            try:
                if self._lost is not None:  # the directory is no longer this writer's
                    raise OSError(f"not written: {one_line(self._lost)}")
                if item is _FINISHED:
                    self._record.finished = True
                    self._write_record()
                elif isinstance(item, UpdateCapture):
                    self._publish_update(UpdateFiles.build(item, self._options.max_samples_per_step, self._layout))
                else:
                    self._write(item)
            except Exception as error:  # noqa: BLE001 - reported on the training thread
                self._record_failure(getattr(item, "step", None), error)
            finally:
                self._queue.task_done()

    def _write(self, snapshot: StepSnapshot) -> None:
        try:
            files = StepFiles.build(snapshot, self._layout)
        finally:  # the tables hold their own copies: the snapshot's memory can serve the next step
            self._memory.give_back(snapshot.block)
        self._publish(files)

    def _record_failure(self, step: int | None, error: BaseException) -> None:
        # Keep where it failed but not the frames' locals, which hold a whole step's arrays.
        traceback.clear_frames(error.__traceback__)
        with self._failures_lock:
            self._failures.append((step, error))

    def _publish(self, files: StepFiles) -> None:
        entry = files.entry
        new_step = not storage.exists(self._fs, storage.join(self._root, entry.file))
        storage.publish(self._fs, self._root, entry.prompts_file, lambda out: pq.write_table(files.prompts, out, **PROMPT_PARQUET_OPTIONS))
        try:
            storage.publish(self._fs, self._root, entry.file, lambda out: pq.write_table(files.tokens, out, **TOKEN_PARQUET_OPTIONS))
        except BaseException:
            if new_step:  # the step is not in the trace: neither is its prompt table (a re-traced
                # step keeps the old token file, whose write id tells the reader the pair differs)
                storage.remove_quietly(self._fs, storage.join(self._root, entry.prompts_file))
            raise
        self._record.steps[str(files.step)] = entry
        try:
            self._write_record()
        except Exception as error:  # noqa: BLE001 - say that the step itself is safe
            raise OSError(
                f"the step is in the trace but {RUN_RECORD} was not updated ({one_line(error)})"
            ) from error

    def _publish_update(self, files: UpdateFiles) -> None:
        entry = files.entry
        storage.publish(self._fs, self._root, entry.file, lambda out: pq.write_table(files.table, out, **UPDATE_PARQUET_OPTIONS))
        step_entry = self._record.steps.get(str(files.step))
        if step_entry is None:  # the step's token table failed: the update table stands on its own
            return
        step_entry.updates[files.kind] = entry
        try:
            self._write_record()
        except Exception as error:  # noqa: BLE001
            raise OSError(
                f"the {files.kind} update is in the trace but {RUN_RECORD} was not updated ({one_line(error)})"
            ) from error

    def _write_record(self) -> None:
        storage.publish_bytes(self._fs, self._root, RUN_RECORD, self._record.to_json())


def _layout_to_write(fs, root: str, shown_path: str, existing: RunRecord | None) -> Layout:
    """:data:`LAYOUT`, unless the directory holds a trace of format 1 or 2 with steps (in its run record
    or on disk): that one goes on in its own layout (HIVE_LAYOUT), with a warning saying so. A trace
    of a later format than 2 has LAYOUT's folders, whatever its columns: it goes on in the newest format."""
    if existing is not None and layout_of(existing.schema_version) == LAYOUT:
        return LAYOUT
    old = bool(existing is not None and existing.steps)
    if not old:
        for info in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
            match = STEP_FILE.fullmatch(posixpath.relpath(info.path, root))
            if match and match.group("separator") == HIVE_LAYOUT.separator:
                old = True
                break
    if not old:
        return LAYOUT
    warnings.warn(
        f"trace dir {shown_path} holds a trace of format {existing.schema_version if existing else 2} "
        "(step=<n> folders): this run's steps go there in that layout (format 2, where pd.read_parquet "
        f"gives step as a category); a new trace dir gets format {LAYOUT.schema_version} (step-<n> folders, an integer step)",
        UserWarning,
        stacklevel=3,
    )
    return HIVE_LAYOUT

"""SQL over a trace: a DuckDB connection with one view per table of the trace (``verl-ext sql``).

    con = connect("/runs/ppo/trace")
    con.sql("SELECT step, avg(advantage) FROM tokens WHERE mask GROUP BY step ORDER BY step").df()

Views, every step of the trace in each, joinable on (step, sample, token_index) (docs/trace_format.md
says what every column is):

* ``tokens``: the token tables, one row per response position (TOKEN_SCHEMA), with ``token``, the
  token decoded by the run's tokenizer (null without one: it loads from local files only);
* ``prompts``: the prompt tables, one row per traced sample;
* ``actor_updates``, ``critic_updates``: the update tables, one row per trained token per PPO epoch
  (no rows in a trace without them);
* ``steps``: the run record's entry of each step (rows, samples, the batch's size, β, the whitening
  statistics, when it was written).

The files are read where they lie, as the query needs them (a trace on this machine's disk only: a
trace at a URL, copy it first), by Arrow datasets that DuckDB scans: DuckDB itself opens no file.

Read-only: the connection reads the trace's files and nothing else, and writes nothing. It is locked
down in DuckDB's own configuration (:data:`LOCKED_DOWN`) once the views exist: no file access at all
(``enable_external_access=false``: no COPY, EXPORT, ATTACH of a file, ``read_csv``/``read_text``/
``glob``/``read_parquet`` of any path, INSTALL or LOAD of an extension, persistent secret, scan of a
Python variable), no extension loaded on demand, and the configuration locked
(``lock_configuration=true``: no SET, RESET or PRAGMA undoes any of it; :data:`ALLOWED_SETTINGS` stay
settable). In-memory tables, views and macros, and ``ATTACH ':memory:'``, are allowed: they go with
the connection. DuckDB spills a query larger than memory to a directory of its own under the system's
temporary directory, removed when the connection closes. ``connect(..., unrestricted=True)`` leaves
DuckDB as it comes (file access, settings), for a caller who means it.

A step whose files do not read (cut short, another write's prompt table: their footers tell, read up
front) is left out of every view and noted in ``unread`` (:class:`~verl_ext.inspect.unread.UnreadSteps`),
as ``summary`` leaves it out.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import uuid

import pyarrow as pa

from verl_ext.errors import StepFileError, UsageError
from verl_ext.steps.layout import as_trace
from verl_ext.trace.schema import PROMPT_SCHEMA, TOKEN_SCHEMA, UPDATE_SCHEMAS

#: The views :func:`connect` makes, in the order ``verl-ext sql --help`` lists them.
VIEWS = ("tokens", "prompts", "actor_updates", "critic_updates", "steps")

STEPS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()), ("rows", pa.int64()), ("samples", pa.int64()), ("batch_samples", pa.int64()),
        ("kl_coef", pa.float64()), ("whiten_mean", pa.float64()), ("whiten_var", pa.float64()), ("written_at", pa.string()),
    ]
)  # fmt: skip

#: DuckDB's settings of a read-only connection, set in this order once the views exist. Once
#: ``lock_configuration`` is true, no statement can change a setting (but those of ALLOWED_SETTINGS),
#: ``lock_configuration`` and ``allowed_configs`` included.
LOCKED_DOWN = (
    ("enable_external_access", False),  # no file opened by DuckDB: read, written, listed, attached, loaded
    ("lock_configuration", True),
)
#: Set when the connection opens: nothing loaded or installed on demand, no community extension, spills
#: to a directory of its own (see :func:`_open`).
STARTUP = {"autoload_known_extensions": False, "autoinstall_known_extensions": False, "allow_community_extensions": False}
#: Settings a locked connection still takes: they change how much a query may use or how it sorts and
#: prints, never what it may read or write.
ALLOWED_SETTINGS = ("threads", "memory_limit", "TimeZone", "default_order", "default_null_order", "enable_progress_bar")
#: The tables read from the trace's files, and what their files are called in a line.
TABLE_FILES = {
    "token_rows": "a token file", "prompts": "a prompt file", "actor_updates": "an actor update file", "critic_updates": "a critic update file",
}  # fmt: skip
#: What a refused statement's line ends with.
READ_ONLY_HINT = "SQL over a trace reads the trace's tables and nothing else, and writes nothing"


def connect(trace, tokenizer=None, *, unread=None, unrestricted: bool = False):
    """A DuckDB connection (in memory) with the views of the module docstring over ``trace`` (open,
    or its path); ``tokenizer`` as ``verl-ext show`` takes it (default: the run record's). Read-only
    (the module docstring) unless ``unrestricted``. ``unread``: where to note a step whose files do not
    read, which is then left out (without it, such a step raises
    :class:`~verl_ext.errors.StepFileError`)."""
    from verl_ext.inspect.table import decoder_for

    trace = _local(trace)
    steps = readable_steps(trace, unread)
    con = _open()
    _views(con, trace, steps, decoder_for(trace, tokenizer), lambda work: work())
    if not unrestricted:
        lock_down(con)
    return con


def query(trace, sql: str, tokenizer=None, unread=None) -> pa.Table:
    """The result of one SQL statement over ``trace``'s read-only views, as an Arrow table; a statement
    DuckDB refuses is a UsageError with DuckDB's first line. ``unread`` as :func:`connect` takes it.
    Ctrl-C (a KeyboardInterrupt in the main thread) stops DuckDB within moments and is raised
    (:class:`Interruptible`)."""
    import duckdb

    from verl_ext.inspect.table import decoder_for

    trace = _local(trace)
    steps = readable_steps(trace, unread)
    decoder = decoder_for(trace, tokenizer)
    con = _open()
    run = Interruptible(con)
    try:
        run(lambda: con.execute("SET enable_progress_bar = false"))  # DuckDB's bar goes to stdout, into the result
        _views(con, trace, steps, decoder, run)
        run(lambda: lock_down(con))
        return run(lambda: _arrow(con.sql(sql)))
    except duckdb.Error as error:
        raise UsageError(_one_line(error, trace)) from None
    finally:
        if not run.running:  # else a statement DuckDB did not stop still uses it
            con.close()


def _one_line(error, trace) -> str:
    """DuckDB's error as one line: its first, with why for a refused statement, and what to run for a
    file whose footer read but whose data did not (the footers were read up front)."""
    import duckdb

    line = str(error).strip().splitlines()[0]
    if isinstance(error, duckdb.PermissionException) or "configuration has been locked" in line:
        return f"{line} ({READ_ONLY_HINT})"
    for table, files in TABLE_FILES.items():
        failed = f"registered as '{table}' failed: "  # how DuckDB says that reading a dataset failed
        if failed in line:
            return f"{files} of {trace.path} does not read ({line.split(failed, 1)[1]}); verl-ext check {trace.path} names it"
    return line


def _arrow(result) -> pa.Table:
    return pa.table({}) if result is None else result.fetch_arrow_table()


def lock_down(con) -> None:
    """Make ``con`` read-only for good (the module docstring): no file access, the configuration
    locked (but :data:`ALLOWED_SETTINGS`)."""
    con.execute(f"SET allowed_configs = [{', '.join(repr(name) for name in ALLOWED_SETTINGS)}]")
    for name, value in LOCKED_DOWN:
        con.execute(f"SET {name} = {str(value).lower()}")


class Interruptible:
    """Runs DuckDB statements on ``con`` so that Ctrl-C stops them. While DuckDB runs a statement in
    the thread that called it, that thread runs no Python, so a Ctrl-C there would wait for the end of
    the query. Called with ``work`` (a function running statements on ``con``), it runs ``work`` in a
    thread of its own and waits: a KeyboardInterrupt in the waiting thread calls ``con.interrupt()``
    until the statement stops (within moments; at most :attr:`PATIENCE` seconds, Ctrl-C pressed again
    meanwhile changes nothing) and is raised. Returns ``work``'s result, or raises its exception."""

    PATIENCE = 10.0

    def __init__(self, con):
        self.con = con
        #: whether a statement DuckDB did not stop may still use ``con`` (it did not answer the interrupt)
        self.running = False

    def __call__(self, work):
        outcome: dict = {}
        done = threading.Event()  # not Thread.is_alive: a join that a KeyboardInterrupt cut can leave it False

        def target() -> None:
            try:
                outcome["value"] = work()
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                outcome["error"] = error
            finally:
                done.set()

        self.running = True
        threading.Thread(target=target, name="verl-ext-sql", daemon=True).start()
        try:
            done.wait()
        except KeyboardInterrupt:
            deadline = time.monotonic() + self.PATIENCE
            while not done.is_set() and time.monotonic() < deadline:
                try:
                    self.con.interrupt()  # again: one that comes between two statements is lost
                    done.wait(0.05)
                except KeyboardInterrupt:
                    pass
            self.running = not done.is_set()
            raise KeyboardInterrupt from None
        self.running = False
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]


def readable_steps(trace, unread=None) -> list[int]:
    """The steps of ``trace`` whose files read (:meth:`~verl_ext.trace.reader.Trace.check_step_files`:
    their footers, no column read). A step that does not is noted in ``unread`` and left out; without
    ``unread``, its StepFileError is raised."""
    steps = []
    for step in trace.steps:
        try:
            trace.check_step_files(step)
        except StepFileError as error:
            if unread is None:
                raise
            unread.unreadable[step] = str(error)
            continue
        steps.append(step)
    return steps


def _local(trace):
    trace = as_trace(trace)
    if trace.local_root is None:
        raise UsageError(f"{trace.path}: SQL reads a trace on this machine's disk; copy it here first")
    return trace


def _open():
    """A new in-memory DuckDB connection with :data:`STARTUP`'s settings; spills go to a directory of
    its own, which DuckDB makes when it first spills and removes when the connection closes."""
    try:
        import duckdb
    except ImportError:
        raise UsageError("SQL over a trace needs DuckDB: pip install 'verl-ext[sql]'") from None
    spills = os.path.join(tempfile.gettempdir(), f"verl-ext-sql-{uuid.uuid4().hex}")
    return duckdb.connect(config={**STARTUP, "temp_directory": spills})


def _views(con, trace, steps: list[int], decoder, run) -> None:
    """The views of the module docstring over ``steps``, ``token`` decoded by ``decoder``. ``run(work)``
    runs ``work``, which runs statements on ``con``; the decoding runs here."""
    run(lambda: _tables(con, trace, steps))
    ids = []
    if decoder.available:
        ids = [row[0] for row in run(lambda: con.execute("SELECT DISTINCT token_id FROM token_rows WHERE token_id IS NOT NULL").fetchall())]
    vocabulary = _vocabulary(decoder, ids)
    columns = ", ".join(f't."{name}"' for name in TOKEN_SCHEMA.names)
    run(lambda: (
        con.register("vocabulary", vocabulary),
        con.execute(
            f"CREATE VIEW tokens AS SELECT {columns}, v.token FROM token_rows t LEFT JOIN vocabulary v USING (token_id) "
            "ORDER BY t.step, t.sample, t.token_index"
        ),
    ))


def _tables(con, trace, steps: list[int]) -> None:
    """Every table but ``tokens`` (``token_rows``: its rows without ``token``)."""
    layout = trace.layout
    _view(con, "token_rows", trace, steps, layout.token_file, TOKEN_SCHEMA)
    _view(con, "prompts", trace, steps, layout.prompt_file, PROMPT_SCHEMA)
    for kind, schema in UPDATE_SCHEMAS.items():
        with_table = [step for step in steps if step in trace.update_steps.get(kind, [])]
        _view(con, f"{kind}_updates", trace, with_table, lambda step, kind=kind: layout.update_file(kind, step), schema)
    con.register("steps", _steps_table(trace))


def _view(con, name: str, trace, steps: list[int], file, schema: pa.Schema) -> None:
    """``name`` over the Parquet file ``file(step)`` of each of ``steps``, read by Arrow as DuckDB
    scans it (columns and filters pushed down: ``WHERE step = 6`` opens step 6's file only), or over
    no rows of ``schema``. Each file is known to hold its step, which fills ``step`` where the file
    does not store it (formats 1 and 2); a column newer than the file is null."""
    import pyarrow.dataset as ds
    import pyarrow.fs as pafs

    if not steps:
        con.register(name, schema.empty_table())
        return
    dataset = ds.FileSystemDataset.from_paths(
        [os.path.join(trace.local_root, file(step)) for step in steps],
        schema=schema,
        format=ds.ParquetFileFormat(),
        filesystem=pafs.LocalFileSystem(),
        partitions=[ds.field("step") == step for step in steps],
    )
    con.register(name, dataset)


def _steps_table(trace) -> pa.Table:
    rows = []
    for key, entry in sorted(trace.record.steps.items(), key=lambda item: int(item[0])):
        whiten = entry.whiten or {}
        rows.append({
            "step": int(key), "rows": entry.rows, "samples": entry.samples, "batch_samples": entry.batch_samples,
            "kl_coef": entry.kl_coef, "whiten_mean": whiten.get("mean"), "whiten_var": whiten.get("var"), "written_at": entry.written_at,
        })  # fmt: skip
    return pa.Table.from_pylist(rows, schema=STEPS_SCHEMA)


def _vocabulary(decoder, ids: list[int]) -> pa.Table:
    """(token_id, token) of each of ``ids`` (the trace's), decoded one id at a time as ``show`` shows
    it; no rows without a tokenizer."""
    from verl_ext.inspect.table import visible

    if not decoder.available:
        return pa.table({"token_id": pa.array([], pa.int32()), "token": pa.array([], pa.string())})
    return pa.table({"token_id": pa.array(ids, pa.int32()), "token": [visible(decoder.text([i]) or "") for i in ids]})

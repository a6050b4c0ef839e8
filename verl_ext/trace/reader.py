"""Read a trace: the run record, one step at a time, or all steps as one dataset.

A :class:`Trace` is a view of the directory as it was when opened (reopen it to see steps written
since). Every problem with the trace itself raises :class:`TraceError` with a one-line message; one
with a file of a single step (missing, cut short, moved there from another step, from another write)
raises its subclass :class:`StepFileError`, which names the step and the file, so that a reader of
many steps can say which one it could not read and go on with the others.
Traces of every readable format give the same tables: format 3 stores ``step`` in its files
(``step-<n>``), formats 1 and 2 only in the folder name (``step=<n>``); see schema.py.
"""

from __future__ import annotations

import json
import posixpath
from typing import TYPE_CHECKING, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from verl_ext.errors import StepFileError, TraceError, UsageError, one_line
from verl_ext.trace import record, storage
from verl_ext.trace.schema import (
    PROMPT_SCHEMA,
    READABLE_SCHEMA_VERSIONS,
    RUN_RECORD,
    SCHEMA_VERSION_METADATA_KEY,
    STEP_FILE,
    STEP_RECORD_METADATA_KEY,
    TOKEN_SCHEMA,
    UPDATE_DIRS,
    UPDATE_RECORD_METADATA_KEY,
    UPDATE_SCHEMAS,
    WRITE_ID_METADATA_KEY,
    Layout,
    RunRecord,
    StepEntry,
    UpdateEntry,
    added_after,
    layout_of,
)

if TYPE_CHECKING:
    import pandas
    import polars



def open_trace(path: str, *, filesystem=None) -> "Trace":
    """Open the trace at ``path`` (local path or fsspec URL; with ``filesystem``, a
    ``pyarrow.fs.FileSystem`` or fsspec filesystem, a path inside it).

    Reads only ``_run.json`` and one listing of the directory. Raises TraceError when the path
    does not exist, is not a trace, or has a schema version this code does not read.
    """
    try:
        fs, root = storage.resolve(path, filesystem)
        kind = fs.get_file_info(root).type
    except (OSError, ValueError, ImportError) as error:
        raise TraceError(f"cannot open trace {path}: {one_line(error)}") from None
    if kind == pafs.FileType.NotFound:
        raise TraceError(f"no trace at {path}: the path does not exist")
    if kind != pafs.FileType.Directory:
        raise TraceError(f"{path} is not a trace: it is not a directory")
    run_record = record.read(fs, root, path)
    if run_record is None:
        raise TraceError(f"{path} is not a verl-ext trace: it has no {RUN_RECORD}{_traces_inside(fs, root, path)}")
    steps, updates = _steps_on_disk(fs, root, path, layout_of(run_record.schema_version))
    return Trace(path, run_record, steps, fs, root, updates)


def _traces_inside(fs: pafs.FileSystem, root: str, shown_path: str) -> str:
    """A hint naming the traces directly under ``root`` (a run's output folder holds its trace in
    ``trace/``, the demo's and the recipes'), or "" when there is none."""
    try:
        children = fs.get_file_info(pafs.FileSelector(root, recursive=False))
        traces = [
            posixpath.basename(info.path) for info in children
            if info.type == pafs.FileType.Directory and storage.exists(fs, storage.join(info.path, RUN_RECORD))
        ]  # fmt: skip
    except OSError:
        return ""
    if not traces:
        return ""
    named = [f"{shown_path.rstrip('/')}/{name}" for name in sorted(traces, key=lambda name: (name != "trace", name))]
    return f"; the trace is in {named[0]}" + (f" (also: {', '.join(named[1:3])})" if len(named) > 1 else "") + ": pass that path instead"


def _steps_on_disk(
    fs: pafs.FileSystem, root: str, shown_path: str, layout: Layout
) -> tuple[list[int], dict[str, list[int]]]:
    """Steps with a token file, and per update kind the steps with an update file (one listing).

    A step directory the writer would not have named is a TraceError: ``step-03`` for step 3, or a
    name of the other layout (``step=3`` in a trace of format 3, ``step-3`` in one of format 1 or 2).
    Its data would never be read, and a second directory of the same step would hide which one is real.
    """
    directories = {name: kind for kind, name in UPDATE_DIRS.items()}
    steps: list[int] = []
    updates: dict[str, list[int]] = {kind: [] for kind in UPDATE_DIRS}
    for info in fs.get_file_info(pafs.FileSelector(root, recursive=True)):
        relative = posixpath.relpath(info.path, root)
        match = STEP_FILE.fullmatch(relative)
        if match and info.type == pafs.FileType.File:
            step = int(match.group("step"))
            if match.group("dir") != layout.step_dir(step):
                raise TraceError(
                    f"{shown_path}/{posixpath.dirname(relative)} is not a directory this trace writes: step {step} "
                    f"lives in {layout.step_dir(step)}; remove or rename the copy"
                )
            (updates[directories[match.group("kind")]] if match.group("kind") else steps).append(step)
    return sorted(steps), {kind: sorted(found) for kind, found in updates.items()}


class Trace:
    """A trace directory: ``record`` (the run record), ``steps`` (sorted steps whose token file is
    on disk), and per-step tables. Token tables have TOKEN_SCHEMA's columns in its order (``step``
    included), rows sorted by (sample, token_index); ``layout`` says how the files are named."""

    def __init__(
        self,
        path: str,
        run_record: RunRecord,
        steps: list[int],
        fs: pafs.FileSystem,
        root: str,
        updates: dict[str, list[int]] | None = None,
    ):
        self.path = path
        self.record = run_record
        self.steps = steps
        #: kind ("actor", "critic") -> sorted steps with an update table of that kind on disk
        self.update_steps = updates or {kind: [] for kind in UPDATE_DIRS}
        #: how the files are named, by the format of the run record (schema.py)
        self.layout = layout_of(run_record.schema_version)
        self._fs = fs
        self._root = root
        self._footers: dict[int, dict[bytes, bytes]] = {}

    @property
    def local_root(self) -> str | None:
        """The trace's directory on this machine's disk; None for a trace on another filesystem (a URL)."""
        return self._root if isinstance(self._fs, pafs.LocalFileSystem) else None

    def read_step(self, step: int, columns: list[str] | None = None) -> pa.Table:
        """The token table of one step: ``columns`` (default all) in TOKEN_SCHEMA order."""
        names = _known_columns(columns)
        # With only ``step`` asked for, ``sample`` is still read: it gives the row count.
        file_columns = [name for name in names if name != "step"] or ["sample"]
        table = self._read_parquet(step, self.layout.token_file(step), TOKEN_SCHEMA, file_columns)
        arrays = [pa.array(np.full(table.num_rows, step, np.int64)) if name == "step" else table[name] for name in names]
        return pa.Table.from_arrays(arrays, schema=_subschema(TOKEN_SCHEMA, names))

    def iter_steps(self, columns: list[str] | None = None) -> Iterator[tuple[int, pa.Table]]:
        """(step, token table) for every step in order, reading one step at a time."""
        for step in self.steps:
            yield step, self.read_step(step, columns)

    def prompts(self, step: int) -> pa.Table:
        """The prompt table of one step (PROMPT_SCHEMA): one row per traced sample."""
        self.require_step(step)
        return self._prompt_file(step, PROMPT_SCHEMA.names).replace_schema_metadata(PROMPT_SCHEMA.metadata)

    def check_step_files(self, step: int) -> None:
        """Whether every file of ``step`` reads as its readers above would read it, from the files'
        footers alone (no column is read): the token, prompt and update files are there, readable
        Parquet (a file cut short loses its footer first) of a known schema version, with their columns,
        holding this step (by their statistics) and from the same write; the step's entry is in the
        token file's footer. A StepFileError naming the first file that does not."""
        self.step_record(step)
        self._read_parquet(step, self.layout.token_file(step), TOKEN_SCHEMA, [])
        for kind in UPDATE_DIRS:
            if step in self.update_steps[kind]:
                self._read_file(self.layout.update_file(kind, step), UPDATE_SCHEMAS[kind], [], step)
        self._prompt_file(step, [])

    def _prompt_file(self, step: int, columns: list[str]) -> pa.Table:
        """``columns`` of the step's prompt table, which must come from the token table's write."""
        table = self._read_file(self.layout.prompt_file(step), PROMPT_SCHEMA, columns, step, stores_step=True)
        written_with = (table.schema.metadata or {}).get(WRITE_ID_METADATA_KEY.encode())
        if written_with != self._footer(step).get(WRITE_ID_METADATA_KEY.encode()):
            raise StepFileError(
                f"{self.path}: the prompt table of step {step} comes from another write than its token "
                "table (a re-trace of the step was interrupted); trace the step again",
                step,
                self.layout.prompt_file(step),
            )
        return table

    def update_table(self, kind: str, step: int, columns: list[str] | None = None) -> pa.Table:
        """The update table of ``kind`` ("actor", "critic") at one step (UPDATE_SCHEMAS[kind],
        ``step`` included), sorted by (epoch, sample, token_index); join the token table on
        (step, sample, token_index)."""
        schema = UPDATE_SCHEMAS.get(kind)
        self._require_update(kind, step)
        names = _known_columns(columns, schema)
        file_columns = [name for name in names if name != "step"] or ["sample"]
        table = self._read_file(self.layout.update_file(kind, step), schema, file_columns, step)
        arrays = [pa.array(np.full(table.num_rows, step, np.int64)) if name == "step" else table[name] for name in names]
        return pa.Table.from_arrays(arrays, schema=_subschema(schema, names))

    def actor_update(self, step: int, columns: list[str] | None = None) -> pa.Table:
        """The actor's update table of one step: :meth:`update_table` of "actor"."""
        return self.update_table("actor", step, columns)

    def critic_update(self, step: int, columns: list[str] | None = None) -> pa.Table:
        """The critic's update table of one step: :meth:`update_table` of "critic"."""
        return self.update_table("critic", step, columns)

    def update_record(self, kind: str, step: int) -> UpdateEntry:
        """What the update table of ``kind`` at ``step`` holds, as stored in its footer (incl. verl's logged metrics)."""
        self._require_update(kind, step)
        relative = self.layout.update_file(kind, step)
        footer = self._attempt(relative, lambda file: pq.read_metadata(file).metadata or {}, step)
        entry = footer.get(UPDATE_RECORD_METADATA_KEY.encode())
        if entry is None:
            raise StepFileError(f"{self.path}/{relative} has no update record in its footer", step, relative)
        return UpdateEntry.from_dict(json.loads(entry), f"{self.path}/{relative} footer")

    def step_record(self, step: int) -> StepEntry:
        """The step's entry of the run record, as stored with its data (the token file's footer)."""
        entry = self._footer(step).get(STEP_RECORD_METADATA_KEY.encode())
        relative = self.layout.token_file(step)
        if entry is None:
            raise StepFileError(f"{self.path}/{relative} has no step record in its footer", step, relative)
        return StepEntry.from_dict(json.loads(entry), f"{self.path}/{relative} footer")

    def dataset(self) -> ds.Dataset:
        """The token files of ``steps`` as one ``pyarrow.dataset`` (TOKEN_SCHEMA), in either layout:
        each file is known to hold its step, which fills ``step`` where the file does not store it."""
        return ds.FileSystemDataset.from_paths(
            [storage.join(self._root, self.layout.token_file(step)) for step in self.steps],
            schema=TOKEN_SCHEMA,
            format=ds.ParquetFileFormat(),
            filesystem=self._fs,
            partitions=[ds.field("step") == step for step in self.steps],
        )

    def to_pandas(self, step: int | None = None) -> "pandas.DataFrame":
        """One step, or every step in order, as a pandas DataFrame."""
        return self._table(step).to_pandas()

    def to_polars(self, step: int | None = None) -> "polars.DataFrame":
        """One step, or every step in order, as a polars DataFrame."""
        import polars

        return polars.from_arrow(self._table(step))

    # ------------------------------------------------------------------ internals

    def _table(self, step: int | None) -> pa.Table:
        if step is not None:
            return self.read_step(step)
        return pa.concat_tables([self.read_step(s) for s in self.steps] or [TOKEN_SCHEMA.empty_table()])

    def _require_update(self, kind: str, step: int) -> None:
        if kind not in UPDATE_DIRS:
            raise UsageError(f"unknown update kind {kind!r}; the kinds are {', '.join(UPDATE_DIRS)}")
        if step not in self.update_steps[kind]:
            on_disk = self.update_steps[kind]
            raise TraceError(f"{self.path} has no {kind} update table for step {step} (steps with one: {listing(on_disk)})")

    def require_step(self, step: int) -> int:
        """``step``, or a one-line TraceError naming the steps there are."""
        if step not in self.steps:
            raise TraceError(f"{self.path} has no step {step} (steps on disk: {listing(self.steps)})")
        return step

    @property
    def missing_steps(self) -> list[int]:
        """Steps the run record lists whose token file is not on disk (sorted). A step on disk that the
        record lacks is not missing: the writer publishes a step's data before its index entry."""
        return sorted(set(map(int, self.record.steps)) - set(self.steps))

    def _footer(self, step: int) -> dict[bytes, bytes]:
        """Key-value metadata of the step's token file (cached)."""
        if step not in self._footers:
            self.require_step(step)
            relative = self.layout.token_file(step)
            self._footers[step] = self._attempt(relative, lambda file: pq.read_metadata(file).metadata or {}, step)
        return self._footers[step]

    def _read_parquet(self, step: int, relative: str, schema: pa.Schema, columns: list[str]) -> pa.Table:
        """``columns`` of one of the step's files, checked against ``schema`` and cast to its types."""
        self.require_step(step)
        return self._read_file(relative, schema, columns, step)

    def _read_file(
        self, relative: str, schema: pa.Schema, columns: list[str], step: int, stores_step: bool | None = None
    ) -> pa.Table:
        """``columns`` of the file of ``step`` at ``relative``. A file that stores ``step`` (by default as
        the layout says; prompt files always) must hold that step only: a file moved to another step's
        name is a TraceError, not data of the wrong step."""
        stores_step = self.layout.step_in_files if stores_step is None else stores_step

        def read(file) -> pa.Table:
            parquet = pq.ParquetFile(file)
            stored = parquet.schema_arrow  # properties built anew at each use: once here
            names = set(stored.names)
            if dictionary := [name for name in READ_AS_DICTIONARY if name in columns and name in names]:
                parquet = pq.ParquetFile(file, metadata=parquet.metadata, read_dictionary=dictionary)
            version = (stored.metadata or {}).get(SCHEMA_VERSION_METADATA_KEY.encode())
            if version is not None and version.decode() not in map(str, READABLE_SCHEMA_VERSIONS):
                raise TraceError(f"{self.path}/{relative}: schema version {version.decode()} is not supported")
            expected = [name for name in schema.names if stores_step or name != "step"]
            missing = [name for name in expected if name not in names]
            absent = set(missing) & added_after(int(version.decode()) if version is not None else 1)  # null in an older file
            if set(missing) - absent:
                raise TraceError(f"{self.path}/{relative} lacks column(s) {', '.join(n for n in missing if n not in absent)}")
            if stores_step:
                others = _other_steps(parquet, step)
                if others:
                    right = relative.replace(self.layout.step_dir(step), self.layout.step_dir(others[0]), 1)
                    raise TraceError(
                        f"{self.path}/{relative} holds step {', '.join(map(str, others))}, not {step} (it belongs in "
                        f"{right}): it was moved or copied; move it back or remove it"
                    )
            table = parquet.read(columns=[name for name in columns if name not in absent])
            table = table.select([name for name in columns if name not in absent])
            for name in columns:
                if name in absent:  # a version-1 file: the column is null
                    table = table.add_column(columns.index(name), schema.field(name), pa.nulls(table.num_rows, schema.field(name).type))
            return table.cast(_subschema(schema, columns).with_metadata(table.schema.metadata))

        return self._attempt(relative, read, step)

    def _attempt(self, relative: str, read, step: int):
        """``read(file)`` on the opened file ``relative`` of ``step``, its failures as one-line
        StepFileErrors (naming the file)."""
        try:
            with self._fs.open_input_file(storage.join(self._root, relative)) as file:
                return read(file)
        except StepFileError:
            raise
        except TraceError as error:  # what ``read`` found wrong with the file
            raise StepFileError(str(error), step, relative) from None
        except FileNotFoundError:
            raise StepFileError(f"{self.path}/{relative} is missing", step, relative) from None
        except (OSError, ValueError, pa.ArrowException) as error:
            raise StepFileError(f"{self.path}/{relative} is not a readable Parquet file ({one_line(error)})", step, relative) from None


#: String columns of a few distinct values, decoded as dictionary indices and cast to strings once:
#: less than half the cost of decoding each row's string (1 M rows of ``role``: 23 ms against 38 ms).
READ_AS_DICTIONARY = ("role",)


def _other_steps(parquet: pq.ParquetFile, step: int) -> list[int]:
    """The values of the file's ``step`` column other than ``step`` (their smallest and largest when
    there are several), from the row groups' statistics: the column is read only where they lack them."""
    paths = [parquet.metadata.schema.column(i).path for i in range(parquet.metadata.num_columns)]
    index = paths.index("step")
    found: set[int] = set()
    for group in range(parquet.metadata.num_row_groups):
        row_group = parquet.metadata.row_group(group)
        if row_group.num_rows == 0:
            continue
        statistics = row_group.column(index).statistics
        if statistics is None or not statistics.has_min_max:
            return sorted(set(parquet.read(columns=["step"])["step"].unique().to_pylist()) - {step})
        found.update((statistics.min, statistics.max))
    return sorted(found - {step})


def _known_columns(columns: list[str] | None, schema: pa.Schema = TOKEN_SCHEMA) -> list[str]:
    if columns is None:
        return list(schema.names)
    unknown = sorted(set(columns) - set(schema.names))
    if unknown:
        raise UsageError(f"unknown trace column(s) {', '.join(unknown)}; the columns are {', '.join(schema.names)}")
    return [name for name in schema.names if name in columns]


def _subschema(schema: pa.Schema, names: list[str]) -> pa.Schema:
    return pa.schema([schema.field(name) for name in names], metadata=schema.metadata)


def listing(values: list[int]) -> str:
    """A short list of numbers for a message: all of them, or the first and last of many."""
    if not values:
        return "none"
    if len(values) <= 12:
        return ", ".join(map(str, values))
    return f"{values[0]} … {values[-1]} ({len(values)} in all)"

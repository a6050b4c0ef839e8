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

The files are read where they lie, by DuckDB, as the query needs them: a trace on this machine's disk
only (a trace at a URL: copy it first).
"""

from __future__ import annotations

import os

import pyarrow as pa

from verl_ext.steps.layout import as_trace
from verl_ext.errors import UsageError
from verl_ext.trace.schema import PROMPT_SCHEMA, TOKEN_SCHEMA, UPDATE_SCHEMAS

#: The views :func:`connect` makes, in the order ``verl-ext sql --help`` lists them.
VIEWS = ("tokens", "prompts", "actor_updates", "critic_updates", "steps")

STEPS_SCHEMA = pa.schema(
    [
        ("step", pa.int64()), ("rows", pa.int64()), ("samples", pa.int64()), ("batch_samples", pa.int64()),
        ("kl_coef", pa.float64()), ("whiten_mean", pa.float64()), ("whiten_var", pa.float64()), ("written_at", pa.string()),
    ]
)  # fmt: skip


def connect(trace, tokenizer=None):
    """A DuckDB connection (in memory) with the views of the module docstring over ``trace`` (open,
    or its path); ``tokenizer`` as ``verl-ext show`` takes it (default: the run record's)."""
    try:
        import duckdb
    except ImportError:
        raise UsageError("SQL over a trace needs DuckDB: pip install 'verl-ext[sql]'") from None

    trace = as_trace(trace)
    if trace.local_root is None:
        raise UsageError(f"{trace.path}: SQL reads a trace on this machine's disk; copy it here first")
    con = duckdb.connect()
    layout = trace.layout
    _view(con, "token_rows", [layout.token_file(step) for step in trace.steps], trace, TOKEN_SCHEMA, hive=not layout.step_in_files)
    _view(con, "prompts", [layout.prompt_file(step) for step in trace.steps], trace, PROMPT_SCHEMA)
    for kind, schema in UPDATE_SCHEMAS.items():
        files = [layout.update_file(kind, step) for step in trace.update_steps.get(kind, [])]
        _view(con, f"{kind}_updates", files, trace, schema, hive=not layout.step_in_files)
    con.register("steps", _steps_table(trace))
    con.register("vocabulary", _vocabulary(con, trace, tokenizer))
    columns = ", ".join(f't."{name}"' for name in TOKEN_SCHEMA.names)
    con.execute(
        f"CREATE VIEW tokens AS SELECT {columns}, v.token FROM token_rows t LEFT JOIN vocabulary v USING (token_id) "
        "ORDER BY t.step, t.sample, t.token_index"
    )
    return con


def _view(con, name: str, files: list[str], trace, schema: pa.Schema, hive: bool = False) -> None:
    """``name`` over the Parquet ``files`` (relative to the trace), or over no rows of ``schema``."""
    if not files:
        con.register(name, schema.empty_table())
        return
    paths = [os.path.join(trace.local_root, file) for file in files]
    # formats 1 and 2 keep ``step`` in the folder name only (hive partitions)
    columns = ", ".join('CAST(step AS BIGINT) AS step' if n == "step" else f'"{n}"' for n in schema.names)
    listed = ", ".join("'" + path.replace("'", "''") + "'" for path in paths)  # a view takes no parameters
    con.execute(f"CREATE VIEW {name} AS SELECT {columns} FROM read_parquet([{listed}], hive_partitioning = {str(hive).lower()})")


def _steps_table(trace) -> pa.Table:
    rows = []
    for key, entry in sorted(trace.record.steps.items(), key=lambda item: int(item[0])):
        whiten = entry.whiten or {}
        rows.append({
            "step": int(key), "rows": entry.rows, "samples": entry.samples, "batch_samples": entry.batch_samples,
            "kl_coef": entry.kl_coef, "whiten_mean": whiten.get("mean"), "whiten_var": whiten.get("var"), "written_at": entry.written_at,
        })  # fmt: skip
    return pa.Table.from_pylist(rows, schema=STEPS_SCHEMA)


def _vocabulary(con, trace, tokenizer) -> pa.Table:
    """(token_id, token) of every id in the trace's responses, decoded one id at a time as ``show``
    shows it; no rows without a tokenizer."""
    from verl_ext.inspect.table import decoder_for, visible

    empty = pa.table({"token_id": pa.array([], pa.int32()), "token": pa.array([], pa.string())})
    decoder = decoder_for(trace, tokenizer)
    if not decoder.available:
        return empty
    ids = [row[0] for row in con.execute("SELECT DISTINCT token_id FROM token_rows WHERE token_id IS NOT NULL").fetchall()]
    return pa.table({"token_id": pa.array(ids, pa.int32()), "token": [visible(decoder.text([i]) or "") for i in ids]})


def query(trace, sql: str, tokenizer=None) -> pa.Table:
    """The result of one SQL statement over ``trace``'s views, as an Arrow table; a statement DuckDB
    refuses is a UsageError with DuckDB's first line."""
    import duckdb

    con = connect(trace, tokenizer)
    try:
        result = con.sql(sql)
        return pa.table({}) if result is None else result.fetch_arrow_table()
    except duckdb.Error as error:
        raise UsageError(str(error).strip().splitlines()[0]) from None
    finally:
        con.close()

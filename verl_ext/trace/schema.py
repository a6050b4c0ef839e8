"""The trace format: column names, types and layout. This is a public contract; bump
:data:`SCHEMA_VERSION` on any change a reader could notice.

Layout of a trace directory (local path or fsspec URL)::

    TRACE/
      _run.json                   run record: schema version, verl version, trainer, estimator and
                                  options, γ, λ, whitening, KL settings, paths, and per step: rows,
                                  files, time written, β applied
      step=<n>/part-0.parquet     token table of step n (TOKEN_SCHEMA), one row per response
                                  position up to the sample's last valid token
      _prompts/step=<n>.parquet   prompt token ids per sample of step n (PROMPT_SCHEMA)

``step`` is the hive partition key: it lives in the directory name, not inside the files, so
each reader's standard call sees one token table with a ``step`` column:

* pyarrow: ``pyarrow.dataset.dataset(TRACE, format="parquet", partitioning="hive")``
* pandas: ``pandas.read_parquet(TRACE)`` (``step`` comes back as a categorical)
* polars: ``polars.scan_parquet(TRACE + "/step=*/*.parquet", hive_partitioning=True)``
* DuckDB: ``read_parquet('TRACE/step=*/*.parquet', hive_partitioning = true)``

Names beginning with ``_`` or ``.`` (the run record, the prompt tables, files being written) are
skipped by pyarrow's and pandas' discovery and do not match the globs above.

Index convention (DEFINITIONS.md §1): at ``token_index`` t, ``value`` is V(s_t) (state before
token t, includes r_t), ``score``/``reward``/``kl`` belong to token t, ``return`` is the critic's
target for V(s_t), ``advantage`` is the actor's signal for token t (whitened when whitening is on)
and ``advantage_raw`` the advantage before whitening.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1

RUN_RECORD = "_run.json"
PROMPTS_DIR = "_prompts"
TOKEN_FILE = "part-0.parquet"


def step_dir(step: int) -> str:
    return f"step={step}"


def prompt_file(step: int) -> str:
    return f"{PROMPTS_DIR}/step={step}.parquet"


#: Per-token float columns, in order; each is null where the run has no such tensor
#: (no critic: value; no reference policy: ref_log_prob; KL not in the reward: kl; …).
FLOAT_COLUMNS = (
    "score",
    "reward",
    "value",
    "return",
    "advantage",
    "advantage_raw",
    "old_log_prob",
    "ref_log_prob",
    "kl",
)

#: Columns stored in ``step=<n>/part-0.parquet`` (``step`` itself comes from the directory).
TOKEN_FILE_SCHEMA = pa.schema(
    [
        pa.field("sample", pa.int32(), nullable=False),
        pa.field("uid", pa.string()),
        pa.field("token_index", pa.int32(), nullable=False),
        pa.field("token_id", pa.int32()),
        pa.field("mask", pa.bool_(), nullable=False),
        *(pa.field(name, pa.float32()) for name in FLOAT_COLUMNS),
    ],
    metadata={"verl_ext.schema_version": str(SCHEMA_VERSION)},
)

PROMPT_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("sample", pa.int32(), nullable=False),
        pa.field("uid", pa.string()),
        pa.field("prompt_token_ids", pa.list_(pa.int32())),
    ],
    metadata={"verl_ext.schema_version": str(SCHEMA_VERSION)},
)

#: The token table as a reader sees it: the file columns plus the partition key.
TOKEN_SCHEMA = pa.schema([pa.field("step", pa.int64(), nullable=False), *TOKEN_FILE_SCHEMA], metadata=TOKEN_FILE_SCHEMA.metadata)

REQUIRED_COLUMNS = tuple(TOKEN_SCHEMA.names)

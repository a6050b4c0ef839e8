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
      _tmp/                       files being written (invisible to readers; cleared by the next writer)

``step`` is the hive partition key: it lives in the directory name, not inside the files, so
each reader's standard call sees one token table with a ``step`` column:

* pyarrow: ``pyarrow.dataset.dataset(TRACE, format="parquet", partitioning="hive")``
* pandas: ``pandas.read_parquet(TRACE)`` (``step`` comes back as a categorical)
* polars: ``polars.scan_parquet(TRACE + "/step=*/*.parquet", hive_partitioning=True)``
* DuckDB: ``read_parquet('TRACE/step=*/*.parquet', hive_partitioning = true)``

Names beginning with ``_`` or ``.`` (the run record, the prompt tables, files being written) are
skipped by pyarrow's and pandas' discovery and do not match the globs above.

Rows: sample i of a traced step contributes token_index 0 … L_i − 1, where L_i − 1 is its last valid
response position; masked interior positions are rows with ``mask = false`` (their float values are
whatever the trainer had there, not part of the contract, docs/definitions.md §7), a sample without any valid
token has no rows. ``sample`` is the row in the trainer's batch; when ``max_samples_per_step`` = N is
smaller than the batch, samples 0 … N − 1 are kept. Files are sorted by (sample, token_index).

Run record (``_run.json``, a JSON object; keys set by the integration unless marked)::

    schema_version     int, SCHEMA_VERSION of the writer (set by the writer)
    verl_ext_version   str
    verl_version       str
    trainer            "legacy" | "v1"
    created_at         ISO 8601 UTC
    algorithm          {adv_estimator, gamma, lam, n_step, lam_critic, lam_actor, lam_length_alpha,
                        whiten_advantages, norm_adv_by_std_in_grpo, use_kl_in_reward, kl_penalty,
                        kl_ctrl{...}}
    model_path         str
    tokenizer_path     str
    rollout_n          int
    trace              TraceOptions.as_dict()
    steps              {"<n>": step entry} (set by the writer, one entry per written step; a writer
                        resuming into the same directory keeps the entries already there)

Step entry (``steps["<n>"]``, keys STEP_RECORD_KEYS). The same entry is stored in the token file's
footer under STEP_RECORD_METADATA_KEY; that copy is the authoritative one (it is published with the
data), ``steps`` is an index that can lag behind it when the writer was killed in between::

    rows               int, rows in the token file
    samples            int, samples traced (N)
    batch_samples      int, samples in the trainer's batch (B ≥ N)
    file               "step=<n>/part-0.parquet" (relative to the trace directory)
    prompts_file       "_prompts/step=<n>.parquet"
    written_at         ISO 8601 UTC, when the writer started writing the step
    kl_coef            float | null, the β applied at this step
    whiten             {"mean": μ, "var": σ²} | null: the statistics ``masked_whiten`` uses, of
                       advantage_raw over the valid tokens of the FULL batch (all B samples):
                       μ = Σx/(n + 1e-8), σ² = Σ(x − μ)²/(n + 1e-8) · n/(n − 1) (sums in float64);
                       null when advantage_raw is absent or fewer than 2 tokens are valid

Index convention (docs/definitions.md §1): at ``token_index`` t, ``value`` is V(s_t) (state before
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
TMP_DIR = "_tmp"

#: Keys of a step entry in the run record (documented above).
STEP_RECORD_KEYS = ("rows", "samples", "batch_samples", "file", "prompts_file", "written_at", "kl_coef", "whiten")

#: Footer (Parquet key-value metadata) key of the token file holding its step entry as JSON.
STEP_RECORD_METADATA_KEY = "verl_ext.step_record"

#: Footer key of both files of a step, equal when they come from the same write.
WRITE_ID_METADATA_KEY = "verl_ext.write_id"

#: Footer key of every Parquet file of a trace: the SCHEMA_VERSION it was written with.
SCHEMA_VERSION_METADATA_KEY = "verl_ext.schema_version"


def step_dir(step: int) -> str:
    return f"step={step}"


def prompt_file(step: int) -> str:
    return f"{PROMPTS_DIR}/step={step}.parquet"


def token_file(step: int) -> str:
    return f"{step_dir(step)}/{TOKEN_FILE}"


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
    metadata={SCHEMA_VERSION_METADATA_KEY: str(SCHEMA_VERSION)},
)

PROMPT_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("sample", pa.int32(), nullable=False),
        pa.field("uid", pa.string()),
        pa.field("prompt_token_ids", pa.list_(pa.int32())),
    ],
    metadata={SCHEMA_VERSION_METADATA_KEY: str(SCHEMA_VERSION)},
)

#: The token table as a reader sees it: the file columns plus the partition key.
TOKEN_SCHEMA = pa.schema([pa.field("step", pa.int64(), nullable=False), *TOKEN_FILE_SCHEMA], metadata=TOKEN_FILE_SCHEMA.metadata)

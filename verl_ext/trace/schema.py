"""The trace format: layout, columns, the run record. This is a public contract; bump
:data:`SCHEMA_VERSION` on any change a reader could notice.

Layout of a trace directory (local path or fsspec URL)::

    TRACE/
      _run.json                   the run record (:class:`RunRecord`)
      step=<n>/part-0.parquet     token table of step n (TOKEN_SCHEMA), one row per response
                                  position up to the sample's last valid token
      _prompts/step=<n>.parquet   one row per traced sample of step n (PROMPT_SCHEMA)
      _tmp/                       files being written (invisible to readers; removed by a clean close)

``step`` is the hive partition key: it lives in the directory name, not inside the files, so each
reader's standard call sees one token table with a ``step`` column (the README gives the calls that
make it an integer in every reader). Names beginning with ``_`` or ``.`` (the run record, the
prompt tables, files being written) are skipped by pyarrow's and pandas' discovery and do not match
the ``step=*/*.parquet`` globs.

Rows: sample i of a traced step contributes token_index 0 … L_i − 1, where L_i − 1 is its last valid
response position; masked interior positions are rows with ``mask = false`` (their float values are
whatever the trainer had there, not part of the contract, docs/definitions.md §7), a sample without
any valid token has no rows. ``sample`` is the row in the trainer's batch; when
``max_samples_per_step`` = N is smaller than the batch, samples 0 … N − 1 are kept. Files are
sorted by (sample, token_index).

Index convention (docs/definitions.md §1): at ``token_index`` t, ``value`` is V(s_t) (state before
token t, includes r_t), ``score``/``reward``/``kl`` belong to token t, ``return`` is the critic's
target for V(s_t), ``advantage`` is the actor's signal for token t. Each column's meaning is in
:data:`TOKEN_COLUMNS`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from verl_ext.errors import TraceError

SCHEMA_VERSION = 1
#: Schema versions this code reads.
READABLE_SCHEMA_VERSIONS = (1,)

RUN_RECORD = "_run.json"
PROMPTS_DIR = "_prompts"
TOKEN_FILE = "part-0.parquet"
TMP_DIR = "_tmp"

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


# --------------------------------------------------------------------------- columns


@dataclass(frozen=True)
class Column:
    """One column of a trace table: its type, meaning, and the verl batch tensor it comes from."""

    name: str
    type: pa.DataType
    doc: str
    #: Key of the (B, T) tensor in verl's ``DataProto.batch`` the column is copied from; None when
    #: verl-ext computes it (raw advantage, kl) or it is not a per-token tensor.
    verl_key: str | None = None
    nullable: bool = True

    @property
    def field(self) -> pa.Field:
        return pa.field(self.name, self.type, nullable=self.nullable)


#: The token table's float columns: float32, null where the run has no such tensor (no critic:
#: value; no reference policy: ref_log_prob; KL not in the reward: kl; …).
FLOAT_COLUMNS = (
    Column("score", pa.float32(), "task score s_t of token t (an outcome score sits on the last valid token)", "token_level_scores"),
    Column("reward", pa.float32(), "r_t = s_t − β·kl_t with KL in the reward, else s_t", "token_level_rewards"),
    Column("value", pa.float32(), "V(s_t): the critic's value of the state before token t", "values"),
    Column("return", pa.float32(), "the critic's regression target for V(s_t)", "returns"),
    Column("advantage", pa.float32(), "the actor's signal for token t (whitened when whitening is on)", "advantages"),
    Column("advantage_raw", pa.float32(), "the advantage before whitening (docs/definitions.md §4)"),
    Column("old_log_prob", pa.float32(), "log π_old(y_t | s_t), the policy that generated the step", "old_log_probs"),
    Column("ref_log_prob", pa.float32(), "log π_ref(y_t | s_t) of the reference policy", "ref_log_prob"),
    Column("kl", pa.float32(), "kld_t = kl_penalty(old_log_prob, ref_log_prob), before β (KL in the reward only)"),
)  # fmt: skip
FLOAT_COLUMN_NAMES = tuple(column.name for column in FLOAT_COLUMNS)

#: Columns stored in ``step=<n>/part-0.parquet`` (``step`` itself comes from the directory name).
TOKEN_FILE_COLUMNS = (
    Column("sample", pa.int32(), "row of the sample in the trainer's batch", nullable=False),
    Column("uid", pa.string(), "verl's prompt id: the samples of one prompt share it"),
    Column("token_index", pa.int32(), "t, the position in the response (0 = first response token)", nullable=False),
    Column("token_id", pa.int32(), "y_t, the response token", "responses"),
    Column("mask", pa.bool_(), "true on trainable tokens (response_mask)", "response_mask", nullable=False),
    *FLOAT_COLUMNS,
)
STEP_COLUMN = Column("step", pa.int64(), "the training step (verl's global_steps, from 1)", nullable=False)
TOKEN_COLUMNS = (STEP_COLUMN, *TOKEN_FILE_COLUMNS)

_VERSION = {SCHEMA_VERSION_METADATA_KEY: str(SCHEMA_VERSION)}
TOKEN_FILE_SCHEMA = pa.schema([c.field for c in TOKEN_FILE_COLUMNS], metadata=_VERSION)
#: The token table as a reader sees it: the file columns plus the partition key.
TOKEN_SCHEMA = pa.schema([c.field for c in TOKEN_COLUMNS], metadata=_VERSION)

PROMPT_COLUMNS = (
    STEP_COLUMN,
    Column("sample", pa.int32(), "row of the sample in the trainer's batch", nullable=False),
    Column("uid", pa.string(), "verl's prompt id"),
    Column("prompt_token_ids", pa.list_(pa.int32()), "the prompt's token ids, without padding", "prompts"),
)
PROMPT_SCHEMA = pa.schema([c.field for c in PROMPT_COLUMNS], metadata=_VERSION)


# --------------------------------------------------------------------------- the run record


@dataclass
class StepEntry:
    """What the run record says about one written step. The same entry is stored in the token
    file's footer under STEP_RECORD_METADATA_KEY; that copy is the authoritative one (it is published
    with the data), ``RunRecord.steps`` is an index that can lag behind it when the writer was killed."""

    rows: int  # rows in the token file
    samples: int  # samples traced (N)
    batch_samples: int  # samples in the trainer's batch (B ≥ N)
    file: str  # "step=<n>/part-0.parquet", relative to the trace directory
    prompts_file: str  # "_prompts/step=<n>.parquet"
    written_at: str  # ISO 8601 UTC, when the writer started writing the step
    kl_coef: float | None  # the β applied at this step
    #: {"mean": μ, "var": σ²}: the statistics ``masked_whiten`` uses, of advantage_raw over the valid
    #: tokens of the FULL batch (all B samples), sums in float64; null when advantage_raw is absent
    #: or fewer than 2 tokens are valid.
    whiten: dict[str, float] | None

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "StepEntry":
        return _from_dict(cls, data, where)


@dataclass
class RunRecord:
    """``_run.json``: how the run was configured, and an index of the written steps."""

    verl_ext_version: str
    verl_version: str
    trainer: str  # "legacy" | "v1"
    created_at: str  # ISO 8601 UTC
    #: {adv_estimator, gamma, lam, the estimator's options, whiten_advantages, estimator_module,
    #: norm_adv_by_std_in_grpo, use_kl_in_reward, kl_penalty, kl_ctrl{...}}
    algorithm: dict[str, Any]
    model_path: str | None
    tokenizer_path: str | None
    rollout_n: int | None
    trace: dict[str, Any]  # TraceOptions.as_dict()
    #: {"<n>": StepEntry}, set by the writer; a writer resuming into the directory keeps those there
    steps: dict[str, StepEntry] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def to_json(self) -> bytes:
        """JSON bytes, steps in numeric order; TypeError/ValueError if something is not JSON data."""
        data = dataclasses.asdict(self)
        data["steps"] = dict(sorted(data["steps"].items(), key=lambda item: int(item[0])))
        return json.dumps(data, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes | str, where: str) -> "RunRecord":
        """Parse and check a run record; TraceError naming ``where`` when it is not one this code reads."""
        try:
            data = json.loads(raw)
        except ValueError as error:
            raise TraceError(f"{where}: {RUN_RECORD} is not readable JSON ({error})") from None
        if not isinstance(data, dict) or not isinstance(data.get("steps", {}), dict):
            raise TraceError(f"{where}: {RUN_RECORD} is not a verl-ext run record")
        version = data.get("schema_version")
        if version not in READABLE_SCHEMA_VERSIONS:
            raise TraceError(
                f"{where}: trace schema version {version!r} is not supported by this verl-ext "
                f"(it reads {', '.join(map(str, READABLE_SCHEMA_VERSIONS))})"
            )
        record = _from_dict(cls, data, f"{where}/{RUN_RECORD}")
        record.steps = {str(k): StepEntry.from_dict(v, f"{where}/{RUN_RECORD} steps[{k}]") for k, v in record.steps.items()}
        return record


def _from_dict(cls, data: Any, where: str):
    if not isinstance(data, dict):
        raise TraceError(f"{where} is not a JSON object")
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    missing = sorted(required - set(data))
    if missing:
        raise TraceError(f"{where} lacks {', '.join(missing)}")
    return cls(**{key: value for key, value in data.items() if key in names})

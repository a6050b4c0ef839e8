"""The trace format's definition: its columns (one :class:`Column` record each), the run record and
how a step's files are named. This is a public contract; bump :data:`SCHEMA_VERSION` on any change a
reader could notice. Not the reader or the writer (trace/reader.py, trace/writer.py), and not where
the format is described: docs/trace_format.md has the layout, the format history, the tables and how
to read them; docs/definitions.md §9 what each number means.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from verl_ext.errors import TraceError

SCHEMA_VERSION = 11
#: Schema versions this code reads: every one so far. A column missing from an older file (its
#: ``Column.since``) reads as null; version 1 also has no update tables. Versions 1 and 2 name a
#: step's files ``step=<n>`` and store ``step`` only in that name (:data:`HIVE_LAYOUT`).
READABLE_SCHEMA_VERSIONS = tuple(range(1, SCHEMA_VERSION + 1))

RUN_RECORD = "_run.json"
PROMPTS_DIR = "_prompts"
#: Update tables, by kind: "actor" and "critic".
UPDATE_DIRS = {"actor": "_actor_update", "critic": "_critic_update"}
TOKEN_FILE = "part-0.parquet"
TMP_DIR = "_tmp"

#: Footer (Parquet key-value metadata) key of the token file holding its step entry as JSON.
STEP_RECORD_METADATA_KEY = "verl_ext.step_record"
#: Footer key of both files of a step, equal when they come from the same write.
WRITE_ID_METADATA_KEY = "verl_ext.write_id"
#: Footer key of every Parquet file of a trace: the SCHEMA_VERSION it was written with.
SCHEMA_VERSION_METADATA_KEY = "verl_ext.schema_version"




@dataclass(frozen=True)
class Layout:
    """How a trace names a step's files, and whether its token and update files store ``step``."""

    #: between ``step`` and the number: ``step-<n>`` (format 3), ``step=<n>`` (formats 1, 2)
    separator: str
    #: the schema version a writer writes in this layout
    schema_version: int

    @property
    def step_in_files(self) -> bool:
        """Token and update files store ``step`` (prompt files always do)."""
        return self.separator == "-"

    def step_dir(self, step: int) -> str:
        return f"step{self.separator}{step}"

    def token_file(self, step: int) -> str:
        return f"{self.step_dir(step)}/{TOKEN_FILE}"

    def prompt_file(self, step: int) -> str:
        return f"{PROMPTS_DIR}/{self.step_dir(step)}.parquet"

    def update_file(self, kind: str, step: int) -> str:
        return f"{UPDATE_DIRS[kind]}/{self.step_dir(step)}/{TOKEN_FILE}"

    def stored(self, table: pa.Table, *, prompts: bool = False) -> pa.Table:
        """``table`` (``step`` included, as the reader gives it) as this layout stores it."""
        if self.step_in_files:
            return table
        if not prompts:
            table = table.drop_columns(["step"])
        version = {SCHEMA_VERSION_METADATA_KEY.encode(): str(self.schema_version).encode()}
        return table.replace_schema_metadata({**(table.schema.metadata or {}), **version})


#: The layout of formats 3 to 10: ``step-<n>``, ``step`` stored in every file.
LAYOUT = Layout("-", SCHEMA_VERSION)
#: The layout of formats 1 and 2: ``step=<n>``, a hive partition (``step`` only in the folder name).
HIVE_LAYOUT = Layout("=", 2)


def layout_of(schema_version: int) -> Layout:
    """The layout of a trace whose run record has ``schema_version``."""
    return LAYOUT if schema_version >= 3 else HIVE_LAYOUT


#: A step's token or update file, in either layout: (kind directory or None, separator, step digits).
STEP_FILE = re.compile(
    rf"(?:(?P<kind>{'|'.join(UPDATE_DIRS.values())})/)?(?P<dir>step(?P<separator>[-=])(?P<step>\d+))/{re.escape(TOKEN_FILE)}"
)


def step_dir(step: int) -> str:
    return LAYOUT.step_dir(step)


def prompt_file(step: int) -> str:
    return LAYOUT.prompt_file(step)


def token_file(step: int) -> str:
    return LAYOUT.token_file(step)


def update_file(kind: str, step: int) -> str:
    return LAYOUT.update_file(kind, step)


# --------------------------------------------------------------------------- columns


@dataclass(frozen=True)
class Column:
    """One column of a trace table: its type, meaning, the verl batch tensor it comes from, and the
    schema version it appeared in."""

    name: str
    type: pa.DataType
    doc: str
    #: Key of the (B, T) tensor in verl's ``DataProto.batch`` the column is copied from; None when
    #: verl-ext computes it (raw advantage, kl) or it is not a per-token tensor.
    verl_key: str | None = None
    nullable: bool = True
    #: The schema version that added the column: a file of an older version lacks it, and the reader
    #: gives it as null.
    since: int = 1
    #: The field of the V1 trainer's TransferQueue the column is read from; by default ``verl_key``.
    v1_key: str | None = None

    def __post_init__(self) -> None:
        if self.v1_key is None:
            object.__setattr__(self, "v1_key", self.verl_key)

    @property
    def field(self) -> pa.Field:
        return pa.field(self.name, self.type, nullable=self.nullable)


#: The token table's float columns: float32, null where the run has no such tensor (no critic:
#: value; no reference policy: ref_log_prob; KL not in the reward: kl; …).
FLOAT_COLUMNS = (
    Column("score", pa.float32(), "task score s_t of token t (an outcome score sits on the last valid token)", "token_level_scores", v1_key="rm_scores"),
    Column("reward", pa.float32(), "r_t = s_t + turn_score_t + tool_reward_t − β·kl_t (each term where the run has it)", "token_level_rewards"),
    Column("value", pa.float32(), "V(s_t): the critic's value of the state before token t", "values"),
    Column("return", pa.float32(), "the critic's regression target for V(s_t)", "returns"),
    Column("advantage", pa.float32(), "the actor's signal for token t (whitened when whitening is on)", "advantages"),
    Column("advantage_raw", pa.float32(), "the advantage before whitening (docs/definitions.md §4)"),
    Column("old_log_prob", pa.float32(), "log π_old(y_t | s_t), the policy that generated the step", "old_log_probs"),
    Column("ref_log_prob", pa.float32(), "log π_ref(y_t | s_t) of the reference policy", "ref_log_prob"),
    Column("kl", pa.float32(), "kld_t = kl_penalty(old_log_prob, ref_log_prob), before β (KL in the reward only)"),
    Column("rollout_log_prob", pa.float32(), "log-prob of y_t the rollout engine reported (train/inference mismatch: − old_log_prob)", "rollout_log_probs", since=2),
    Column("turn_score", pa.float32(), "the agent loop's score of the turn that ends at token t (verl_ext.turn_rewards; 0 elsewhere)", since=6),
    Column("tool_reward", pa.float32(), "the tool rewards earned by the calls of the turn that ends at token t (verl_ext.turn_rewards; 0 elsewhere)", since=6),
    Column("rollout_is_weight", pa.float32(), "w_t: the rollout-correction importance weight π_old/π_rollout verl computed for token t "
           "(algorithm.rollout_correction.rollout_is; truncated, zeroed or normalised as configured; docs/definitions.md#off-policy-tokens)",
           "rollout_is_weights", since=10),
)  # fmt: skip
FLOAT_COLUMN_NAMES = tuple(column.name for column in FLOAT_COLUMNS)

#: Multi-turn responses (an agent loop's tool answers are mask-0 holes inside the response).
TURN_DOC = (
    "k: the assistant turn of token t (docs/definitions.md §7): 0 up to the end of the first run of the "
    "policy's tokens (mask ∨ rejected), then 1 from the first of them after a hole, …; a hole's tokens keep the turn before it"
)
#: ``role`` values: who wrote a response token, as the agent loop appended it
#: (:mod:`verl_ext.integration.agent_turns`). The only place they are written.
ROLE_CODES = (ROLE_ASSISTANT, ROLE_TOOL, ROLE_USER, ROLE_OTHER) = ("assistant", "tool", "user", "other")
ROLE_DOC = (
    f"who wrote token t: {ROLE_ASSISTANT} on the policy's tokens (mask or rejected true); on a hole's tokens the role of the "
    f"messages the agent loop appended there ({ROLE_TOOL}, {ROLE_USER}; {ROLE_OTHER} for template or boundary tokens "
    "and mixed groups), null when the agent loop did not say"
)
#: The first column of every table of the trace, stored in every file (format 3; formats 1 and 2 kept
#: it in the folder name of the token and update files).
STEP_COLUMN = Column("step", pa.int64(), "the training step (verl's global_steps, from 1)", nullable=False)
#: The columns of ``step-<n>/part-0.parquet``, as stored and as every reader sees them.
TOKEN_COLUMNS = (
    STEP_COLUMN,
    Column("sample", pa.int32(), "row of the sample in the trainer's batch", nullable=False),
    Column("uid", pa.string(), "verl's prompt id: the samples of one prompt share it", v1_key="uid"),
    Column("token_index", pa.int32(), "t, the position in the response (0 = first response token)", nullable=False),
    Column("token_id", pa.int32(), "y_t, the response token", "responses"),
    Column("mask", pa.bool_(), "true on the tokens the advantage and the update used (verl's response_mask, after any rejection)",
           "response_mask", nullable=False),
    Column("rejected", pa.bool_(), "verl's rollout-correction rejection took token t out of the response_mask (algorithm.rollout_correction"
           ".rollout_rs): the policy wrote it, nothing trained on it; the response's own tokens are mask ∨ rejected; null where "
           "verl's correction did not run (no rollout log-probs), false everywhere where it ran and rejected nothing", since=10),
    Column("turn", pa.int32(), TURN_DOC, since=4),
    Column("role", pa.string(), ROLE_DOC, since=5),
    *FLOAT_COLUMNS,
)

_VERSION = {SCHEMA_VERSION_METADATA_KEY: str(SCHEMA_VERSION)}
TOKEN_SCHEMA = pa.schema([c.field for c in TOKEN_COLUMNS], metadata=_VERSION)

PROMPT_COLUMNS = (
    STEP_COLUMN,
    Column("sample", pa.int32(), "row of the sample in the trainer's batch", nullable=False),
    Column("uid", pa.string(), "verl's prompt id"),
    Column("prompt_token_ids", pa.list_(pa.int32()), "the prompt's token ids, without padding", "prompts"),
    Column("response_length", pa.int32(), "L: last valid response position + 1 (0 without a valid token)", since=2),
    Column("eos", pa.bool_(), "the last valid token is an EOS token of the tokenizer", since=2),
    Column("truncated", pa.bool_(), "cut at max_response_length: the last valid token is at the last position and is not EOS "
           "(where algorithm.truncation is not terminal, the cut the estimate used: the same rule)", since=2),
    Column("assistant_turns", pa.int32(), "K: the response's assistant turns (maximal runs of valid tokens)", since=4),
    Column("tool_calls", pa.int32(), "tool messages the agent loop merged into the response; null when it did not say", since=5),
    Column("turn_limit", pa.bool_(), "the agent loop stopped at its turn limit (max_assistant_turns or max_user_turns) "
           "while the last turn still called a tool; null when it did not say", since=5),
    Column("bootstrap_value", pa.float32(), "V(s_L), the critic's value after the last token, which the returns of a truncated "
           "response bootstrapped from (algorithm.truncation=bootstrap, docs/definitions.md#truncated-responses); "
           "null on every other response and in every other run", since=7),
    Column("stop_reason", pa.string(), "the rollout engine's own reason for ending the response's last generation "
           "(vLLM's finish_reason: stop, length, abort); null where the engine does not say (verl_ext.integration.stop_reasons)",
           since=8),
    Column("policy_version_min", pa.int32(), "the version of the policy whose weights generated the response's first token, "
           "in the run's numbering of weight updates (docs/definitions.md#policy-versions); null where the rollout did not say",
           since=11),
    Column("policy_version_max", pa.int32(), "the version that generated its last token: above policy_version_min only where a "
           "partial rollout spanned a weight update; null where the rollout did not say", since=11),
)
PROMPT_SCHEMA = pa.schema([c.field for c in PROMPT_COLUMNS], metadata=_VERSION)

_WHERE_TRAINED = (
    Column("sample", pa.int32(), "row of the sample in the trainer's batch (joins the token table)", nullable=False),
    Column("token_index", pa.int32(), "t, the position in the response (joins the token table)", nullable=False),
    Column("epoch", pa.int32(), "PPO epoch e (0-based)", nullable=False),
    Column("minibatch", pa.int32(), "mini-batch k within the epoch, on its rank (one optimizer step each)", nullable=False),
    Column("microbatch", pa.int32(), "micro-batch within the mini-batch (gradient accumulation)", nullable=False),
    Column("rank", pa.int32(), "data-parallel rank that trained the row", nullable=False),
)
#: ``clip`` values: which clip of vanilla PPO applies to the token (docs/definitions.md §8). The only
#: place they are written: the update hook stores them by index, the checker and the view read them.
CLIP_CODES = (CLIP_NONE, CLIP_LOW, CLIP_HIGH, CLIP_DUAL) = ("none", "low", "high", "dual")
ACTOR_UPDATE_COLUMNS = (
    STEP_COLUMN,
    *_WHERE_TRAINED,
    Column("log_prob", pa.float32(), "log π_θ(y_t | s_t) of the actor as it is when the mini-batch is processed"),
    Column("old_log_prob", pa.float32(), "log π_old(y_t | s_t), as the loss read it"),
    Column("ratio", pa.float32(), "exp(clamp(log_prob − old_log_prob, −20, 20)), as verl computes it"),
    Column("advantage", pa.float32(), "the advantage the loss used (the token table's advantage)"),
    Column("pg_loss", pa.float32(), "the per-token policy-loss term of the configured loss, before aggregation"),
    Column("clip", pa.string(), f"{CLIP_NONE} | {CLIP_LOW} (A<0, ratio<1−ε_low) | {CLIP_HIGH} (A>0, ratio>1+ε_high) | {CLIP_DUAL} (A<0, ratio>c)"),
    Column("entropy", pa.float32(), "entropy of π_θ(· | s_t) where verl computes it (actor.calculate_entropy or entropy_coeff)"),
    Column("is_weight", pa.float32(), "rollout-correction importance weight multiplied into pg_loss, when configured"),
)
CRITIC_UPDATE_COLUMNS = (
    STEP_COLUMN,
    *_WHERE_TRAINED,
    Column("vpred", pa.float32(), "V_φ(s_t) of the value head being trained, when the mini-batch is processed"),
    Column("vpred_clipped", pa.float32(), "clip(vpred, value − ε_v, value + ε_v), ε_v = critic.cliprange_value"),
    Column("value", pa.float32(), "V(s_t) stored in the batch (the token table's value)"),
    Column("return", pa.float32(), "the regression target (the token table's return)"),
    Column("vf_loss", pa.float32(), "max((vpred − return)², (vpred_clipped − return)²), before ×½ and aggregation"),
    Column("vf_clipped", pa.bool_(), "the clipped square is the larger one (counted in critic/vf_clipfrac)"),
)
UPDATE_COLUMNS = {"actor": ACTOR_UPDATE_COLUMNS, "critic": CRITIC_UPDATE_COLUMNS}


def since(name: str) -> int:
    """The schema version that added the token or prompt column ``name`` (its ``Column.since``)."""
    return next(column.since for column in (*TOKEN_COLUMNS, *PROMPT_COLUMNS) if column.name == name)


def added_after(version: int) -> frozenset[str]:
    """Names of the token and prompt columns a file of schema ``version`` lacks (they appeared later).
    The update tables appeared in version 2 with all their columns."""
    return frozenset(column.name for column in (*TOKEN_COLUMNS, *PROMPT_COLUMNS) if column.since > version)


#: The columns the V1 trainer's batch is read back with from TransferQueue (the prompts included).
V1_COLUMNS = tuple(column for column in (*TOKEN_COLUMNS, *PROMPT_COLUMNS) if column.v1_key)
#: Update tables, as stored and as every reader sees them.
UPDATE_SCHEMAS = {kind: pa.schema([c.field for c in columns], metadata=_VERSION) for kind, columns in UPDATE_COLUMNS.items()}
#: Footer key of an update file: its UpdateEntry as JSON.
UPDATE_RECORD_METADATA_KEY = "verl_ext.update_record"


# --------------------------------------------------------------------------- the run record


@dataclass
class StepEntry:
    """What the run record says about one written step. The same entry is stored in the token
    file's footer under STEP_RECORD_METADATA_KEY; that copy is the authoritative one (it is published
    with the data), ``RunRecord.steps`` is an index that can lag behind it when the writer was killed."""

    rows: int  # rows in the token file
    samples: int  # samples traced (N)
    batch_samples: int  # samples in the trainer's batch (B ≥ N)
    file: str  # "step-<n>/part-0.parquet", relative to the trace directory ("step=<n>/…" before format 3)
    prompts_file: str  # "_prompts/step-<n>.parquet"
    written_at: str  # ISO 8601 UTC, when the writer started writing the step
    kl_coef: float | None  # the β applied at this step
    #: {"mean": μ, "var": σ²}: the statistics ``masked_whiten`` uses, of advantage_raw over the valid
    #: tokens of the FULL batch (all B samples; under algorithm.truncation=mask those of the responses
    #: not truncated), sums in float64; null when advantage_raw is absent or fewer than 2 tokens count.
    whiten: dict[str, float] | None
    #: kind ("actor", "critic") -> its UpdateEntry, once the update table is written (run record only)
    updates: dict[str, Any] = field(default_factory=dict)
    #: float column -> the dtype the trainer's batch held it in, where that was not float32 or float64
    #: ("bf16", "fp16": a bf16 run's values, or rewards on the V1 trainer); stored exactly as float32
    stored_dtypes: dict[str, str] = field(default_factory=dict)
    #: (since format 11) verl's own step number of this trace step (``global_steps``): equal to the trace's step
    #: except where one of verl's steps runs several updates (V1 separate_async), each its own trace step;
    #: None: the same as the trace's step (traces before format 11)
    global_step: int | None = None
    #: (since format 11) the update's place among the updates that share one weight sync (0-based): which of
    #: the updates of ``global_step`` this is where verl's step runs several (V1's parameter_sync_step), which of
    #: a version's updates in fully async (trigger_parameter_sync_step > 1); None: a sync follows every update
    substep: int | None = None
    #: (since format 11) the number of the last weights verl sent to the rollout before this update, in the
    #: numbering of the prompts' policy_version_min/max; the update starts from those weights after ``substep``
    #: more local updates, and they are π_old's in decoupled mode. A response's staleness is this minus its
    #: policy_version_min (docs/definitions.md#policy-versions); None: not known
    trainer_version: int | None = None
    #: (since format 10) numbers verl logged for the step that its trace must reproduce: its rollout
    #: correction's ``rollout_corr/…`` (docs/definitions.md#off-policy-tokens); {} where there are none
    logged: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "StepEntry":
        entry = _from_dict(cls, data, where)
        entry.updates = {kind: UpdateEntry.from_dict(u, f"{where} updates[{kind}]") for kind, u in entry.updates.items()}
        return entry


@dataclass
class UpdateEntry:
    """What one update table of a step holds; stored in its footer and in the run record's step entry."""

    kind: str  # "actor" | "critic"
    rows: int
    file: str  # "_actor_update/step-<n>/part-0.parquet"
    written_at: str
    #: verl's own logged metrics of the step for this model (e.g. actor/pg_loss, actor/pg_clipfrac),
    #: which the per-token terms must reproduce.
    logged: dict[str, float]
    #: per (epoch, minibatch): the global batch information verl's loss normalised with:
    #: [{"epoch", "minibatch", "batch_num_tokens", "global_batch_size", "dp_size"}]
    minibatches: list[dict[str, Any]]
    #: (since format 10) [epoch, minibatch, microbatch, rank] of every loss call that had no valid token
    #: (all its tokens rejected by verl's rollout correction, or holes): verl averages its per-micro-batch
    #: metrics over them too, with value 0, and the table has no row of them
    empty_microbatches: list[list[int]] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> "UpdateEntry":
        return _from_dict(cls, data, where)


@dataclass
class RunRecord:
    """``_run.json``: how the run was configured, and an index of the written steps."""

    verl_ext_version: str
    verl_version: str
    trainer: str  # "legacy" | "v1"
    created_at: str  # ISO 8601 UTC
    #: {adv_estimator, gamma, lam, the estimator's options, whiten_advantages, truncation (since
    #: format 7; absent: terminal), estimator_module, norm_adv_by_std_in_grpo, use_kl_in_reward,
    #: kl_penalty, kl_ctrl{...}}
    algorithm: dict[str, Any]
    model_path: str | None
    tokenizer_path: str | None
    rollout_n: int | None
    trace: dict[str, Any]  # TraceOptions.as_dict()
    #: how the update computed its loss (from the actor and critic configs): {"actor": {loss_mode,
    #: loss_agg_mode, clip_ratio_low, clip_ratio_high, clip_ratio_c, ppo_epochs, ppo_mini_batch_size,
    #: shuffle, calculate_entropy, entropy_coeff, loss_scale_factor}, "critic": {cliprange_value,
    #: loss_agg_mode, ppo_epochs, ppo_mini_batch_size, loss_scale_factor}}; empty in version 1
    update: dict[str, Any] = field(default_factory=dict)
    host: str | None = None  # the machine that wrote the trace
    node: str | None = None  # its Ray node id, on a Ray cluster
    #: {"<n>": StepEntry}, set by the writer; a writer resuming into the directory keeps those there
    steps: dict[str, StepEntry] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    #: (since format 8) False from the start of the run, True once the trainer's ``fit()`` returned
    #: after its last step (:meth:`TraceWriter.finish`); None: the record does not say (before format 8)
    finished: bool | None = None
    #: (since format 8) the training steps the trainer planned: verl's ``trainer.total_training_steps``,
    #: or total_epochs × batches per epoch when that is unset; None: unknown
    planned_steps: int | None = None
    #: (since format 8) the engine that generated the responses: {"name": actor_rollout_ref.rollout.name,
    #: "version": its package's installed version (None: unknown), "dtype": what the engine computes in, as its
    #: servers reported it when the trace opened (None: unknown; traces written before issue 59 hold
    #: actor_rollout_ref.rollout.dtype, which hf_generate does not follow)}
    rollout: dict[str, Any] | None = None
    #: (since format 9) this trace is a replay of one step of another (verl_ext.apps.replay): {"of": that
    #: trace's path, "step": n, "mode": "model" | "model-free", "overrides": ["key=value", …],
    #: "minibatches": [[epoch, minibatch], …] (the ones a model-free replay's table holds; None: every
    #: one), and with the model "checkpoint": the run's checkpoint directory}; None: a trace a run wrote
    replay: dict[str, Any] | None = None
    #: (since format 9) verl's whole config as the run resolved it, which ``verl-ext replay`` rebuilds
    #: the actor and critic from; None: not recorded (a trace before format 9, or one that did not resolve)
    config: dict[str, Any] | None = None
    #: (since format 11) how the trainer overlapped generation and training: {"name": "sync" | "separate_async"
    #: | "one_step_off" | "fully_async", and that mode's settings (separate_async: parameter_sync_step;
    #: fully_async: staleness_threshold, trigger_parameter_sync_step, partial_rollout, …)}; None: not recorded
    #: (a trace before format 11: synchronous)
    mode: dict[str, Any] | None = None

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

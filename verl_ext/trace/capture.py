"""From the trainer's batch tensors to the trace's Arrow tables, in two halves.

:func:`take_snapshot` runs on the training thread when a step is submitted. It does the least work
that makes the trace independent of the trainer's tensors, which the trainer may reuse or modify
in place once the hook returns:

* checks shapes (B, T) and reduces the mask to each sample's row count L_i (last valid position + 1);
* computes the whitening statistics of ``advantage_raw`` over the FULL batch (they need all B rows,
  while only the first N may be kept), over the tokens the estimate whitened (without the truncated
  responses under ``algorithm.truncation=mask``);
* copies rows 0 … N − 1 and columns 0 … max L_i − 1 of every tensor into CPU memory recycled from
  written steps (:class:`SnapshotMemory`), converting to the schema's dtypes in the same pass
  (float32, int32, bool).

:class:`StepFiles` runs on the writer thread: :func:`token_table` gathers the positions ``t < L_i``
into the long format of ``TOKEN_SCHEMA``, :func:`prompt_table` builds ``PROMPT_SCHEMA``, and the
step's run-record entry goes into the token file's footer. Both tables have ``step``; the trace's
:class:`~verl_ext.trace.schema.Layout` says how they are stored and named.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import threading
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cached_property
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import torch

from verl_ext.estimators import whitening_moments
from verl_ext.torch_threads import one_torch_thread
from verl_ext.trace.agent_record import ASSISTANT_CODE, AgentRecord
from verl_ext.trace.schema import (
    FLOAT_COLUMN_NAMES,
    LAYOUT,
    PROMPT_SCHEMA,
    ROLE_CODES,
    STEP_RECORD_METADATA_KEY,
    TOKEN_SCHEMA,
    UPDATE_RECORD_METADATA_KEY,
    UPDATE_SCHEMAS,
    WRITE_ID_METADATA_KEY,
    Layout,
    StepEntry,
    UpdateEntry,
)
from verl_ext.truncation import Truncation
from verl_ext.turns import turn_index, turn_starts


@dataclass
class StepCapture:
    """What the integration hands over for one step, right after the advantages are computed.

    Fields are named after the token table's columns. All tensors are (B, T) over the response
    positions unless said otherwise, on any device, of any dtype (bf16, float32, int64, …); a float
    column absent from ``floats`` (or None there) is null in the table. B ≥ 1.
    """

    step: int
    mask: torch.Tensor  # (B, T) 0/1: 1 on trainable response tokens (verl's response_mask)
    token_id: torch.Tensor | None  # (B, T) response token ids
    uid: Sequence[str] | None  # B group ids (verl's non_tensor_batch["uid"], a numpy object array)
    floats: Mapping[str, torch.Tensor | None]  # FLOAT_COLUMN_NAMES -> (B, T)
    prompts: torch.Tensor | None = None  # (B, P) prompt token ids, left-padded as in verl
    prompt_mask: torch.Tensor | None = None  # (B, P) 1 on real prompt tokens; None: every position is one
    kl_coef: float | None = None  # β applied at this step
    eos_token_ids: Sequence[int] | None = None  # what ends a response (for the eos/truncated flags)
    max_response_length: int | None = None  # data.max_response_length (for the truncated flag)
    #: B records of the agent loop (each as AgentRecord.encode wrote it, or None for a sample without
    #: one: verl_ext.trace.agent_record); None: no sample has one
    agent_turns: Sequence[Mapping[str, Any] | None] | None = None
    #: B stop reasons of the rollout engine (vLLM's finish_reason, None where it said none); None: none said
    stop_reasons: Sequence[str | None] | None = None
    #: what the estimate did with the truncated responses (None: terminal): its ``cut`` is the
    #: ``truncated`` flag, its ``bootstrap_value`` the column of that name (bootstrap only), and the
    #: whitening statistics are over its ``whitened_mask``
    truncation: Truncation | None = None


@dataclass(frozen=True)
class StepSnapshot:
    """The writer thread's own copy of one step (N samples kept of B, W = max L_i positions)."""

    step: int
    batch_samples: int  # B
    lengths: np.ndarray  # (N,) int64: rows of each sample, L_i = last valid position + 1 (0: none)
    mask: np.ndarray  # (N, W) bool
    token_id: np.ndarray | None  # (N, W) int32
    floats: dict[str, np.ndarray | None]  # column name -> (N, W) float32
    uid: list[str] | None  # N
    prompt_token_ids: np.ndarray | None  # (N, P) int32
    prompt_mask: np.ndarray | None  # (N, P) bool
    kl_coef: float | None
    whiten: dict[str, float] | None  # {"mean", "var"} of advantage_raw over the full batch
    block: torch.Tensor  # the memory all arrays above live in (see SnapshotMemory)
    eos: np.ndarray | None = None  # (N,) bool: the last valid token is an EOS token
    truncated: np.ndarray | None = None  # (N,) bool: the last valid token is at max_response_length − 1, not EOS
    bootstrap_value: np.ndarray | None = None  # (N,) float32: V(s_L), read where ``truncated`` (bootstrap only)
    role: np.ndarray | None = None  # (N, W) int8: index into ROLE_CODES, −1 where unknown
    tool_calls: np.ndarray | None = None  # (N,) int32, −1 where unknown
    turn_limit: np.ndarray | None = None  # (N,) int8: 1, 0, −1 where unknown
    stop_reason: list[str | None] | None = None  # N: the rollout engine's, None where it said none
    stored_dtypes: dict[str, str] = field(default_factory=dict)  # StepEntry.stored_dtypes

    @property
    def samples(self) -> int:
        return len(self.lengths)

    @property
    def rows(self) -> int:
        return int(self.lengths.sum())

    @cached_property
    def turn_starts(self) -> np.ndarray:
        """(N, W) bool: the first token of every assistant turn (:func:`verl_ext.turns.turn_starts`),
        for the token table's ``turn`` and the prompt table's ``assistant_turns``."""
        return turn_starts(self.mask)


def take_snapshot(capture: StepCapture, max_samples: int | None, memory: "SnapshotMemory | None" = None) -> StepSnapshot:
    """Copy what the step's files need (synchronous part). Keeps the first ``max_samples`` samples.

    The copies go into one block taken from ``memory`` (fresh memory without it); whoever is done
    with the snapshot gives ``snapshot.block`` back. Raises ValueError naming the field when a
    shape does not match ``mask``'s (B, T).
    """
    _check(capture)
    batch, length = capture.mask.shape
    kept = batch if max_samples is None else min(batch, max_samples)
    # What is copied: (tensor, dtype in the snapshot) per array, over response or prompt positions.
    response_arrays = {
        "mask": (capture.mask, torch.bool),
        "token_id": (capture.token_id, torch.int32),
        **{name: (capture.floats.get(name), torch.float32) for name in FLOAT_COLUMN_NAMES},
    }
    prompt_arrays = {"prompt_token_ids": (capture.prompts, torch.int32), "prompt_mask": (capture.prompt_mask, torch.bool)}
    prompt_shape = None if capture.prompts is None else (kept, capture.prompts.shape[1])
    # The block is sized for the full length T, not the longest response, so that in a run with a
    # fixed batch shape every recycled block fits every step.
    nbytes = _bytes(response_arrays, (kept, length)) + _bytes(prompt_arrays, prompt_shape)
    block = _Block((memory or SnapshotMemory()).take(nbytes))
    with one_torch_thread():
        lengths = _row_counts(capture.mask[:kept])
        shape = (kept, int(lengths.max()))
        copies = {name: block.copy(tensor, shape, dtype) for name, (tensor, dtype) in response_arrays.items()}
        copies |= {name: block.copy(tensor, prompt_shape, dtype) for name, (tensor, dtype) in prompt_arrays.items()}
        return StepSnapshot(
            step=int(capture.step),
            batch_samples=batch,
            lengths=lengths.numpy(),
            mask=copies["mask"],
            token_id=copies["token_id"],
            floats={name: copies[name] for name in FLOAT_COLUMN_NAMES},
            uid=None if capture.uid is None else [str(u) for u in capture.uid[:kept]],
            prompt_token_ids=copies["prompt_token_ids"],
            prompt_mask=copies["prompt_mask"],
            kl_coef=None if capture.kl_coef is None else float(capture.kl_coef),
            whiten=whiten_stats(capture.floats.get("advantage_raw"), _whitened_mask(capture)),
            block=block.memory,
            stored_dtypes={
                name: _LOW_PRECISION[tensor.dtype]
                for name, tensor in capture.floats.items()
                if tensor is not None and tensor.dtype in _LOW_PRECISION
            },
            **_end_flags(capture, lengths.numpy(), copies["token_id"]),
            **_agent_turns(capture.agent_turns, copies["mask"], lengths.numpy()),
            stop_reason=None if capture.stop_reasons is None else [_reason(r) for r in capture.stop_reasons[:kept]],
        )


#: Batch dtypes below float32 and their names in StepEntry.stored_dtypes.
_LOW_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class SnapshotMemory:
    """Recycles the memory of snapshots that were written, for the next ones (thread-safe).

    A snapshot is ~80 MB at 512 × 4096; copying into fresh memory page-faults all of it, which
    measured 20-50 ms per submit on a busy machine, more than the copies themselves. A block is
    only created when none is free, so there are never more blocks than the most snapshots alive
    at once (queue_size + 2 in a writer: queued, being written, being submitted).
    """

    def __init__(self):
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 block of at least ``nbytes``: a free one, or a new one (free ones too small are dropped)."""
        with self._lock:
            while self._free:
                block = self._free.pop()
                if block.numel() >= nbytes:
                    return block
        return torch.empty(nbytes, dtype=torch.uint8)

    def give_back(self, block: torch.Tensor) -> None:
        """Return a block; nothing may use the snapshot it held any more."""
        with self._lock:
            self._free.append(block)


def whiten_stats(values: torch.Tensor | None, mask: torch.Tensor) -> dict[str, float] | None:
    """{"mean": μ, "var": σ²} as ``masked_whiten`` computes them over the valid entries of (B, T)
    (:func:`verl_ext.estimators.whitening_moments`: sums in float64, σ² unbiased).

    None without values or with fewer than 2 valid entries (where ``masked_whiten`` raises).
    """
    if values is None:
        return None
    count, mean, var = whitening_moments(values, mask)
    return {"mean": mean, "var": var} if count >= 2 else None


def token_table(snapshot: StepSnapshot) -> pa.Table:
    """The long-format token table (TOKEN_SCHEMA), sorted by (sample, token_index)."""
    rows = snapshot.rows
    width = snapshot.mask.shape[1]
    # (N, W) selection of the positions t < L_i; boolean indexing walks it row-major, so every
    # column comes out in (sample, token_index) order.
    keep = np.arange(width) < snapshot.lengths[:, None]
    sample = np.repeat(np.arange(snapshot.samples, dtype=np.int32), snapshot.lengths)
    first_row = np.cumsum(snapshot.lengths) - snapshot.lengths
    token_index = (np.arange(rows) - np.repeat(first_row, snapshot.lengths)).astype(np.int32)
    uid = pa.nulls(rows, pa.string()) if snapshot.uid is None else pa.array(snapshot.uid, pa.string()).take(sample)

    def gather(array: np.ndarray | None, arrow_type: pa.DataType) -> pa.Array:
        return pa.nulls(rows, arrow_type) if array is None else pa.array(array[keep], arrow_type)

    return pa.Table.from_arrays(
        [
            np.full(rows, snapshot.step, np.int64),
            sample,
            uid,
            token_index,
            gather(snapshot.token_id, pa.int32()),
            gather(snapshot.mask, pa.bool_()),
            gather(turns(snapshot.turn_starts), pa.int32()),
            _codes(None if snapshot.role is None else snapshot.role[keep], ROLE_CODES, rows),
            *(gather(snapshot.floats[name], pa.float32()) for name in FLOAT_COLUMN_NAMES),
        ],
        schema=TOKEN_SCHEMA,
    )


def turns(starts: np.ndarray) -> np.ndarray:
    """(N, W) turn starts -> (N, W) int32: the assistant turn of every position (schema.TURN_DOC): the
    turns begun up to it, less one (:func:`verl_ext.turns.turn_index`); 0 before the first."""
    return np.maximum(turn_index(starts), 0).astype(np.int32)


def prompt_table(snapshot: StepSnapshot) -> pa.Table:
    """One row per kept sample (PROMPT_SCHEMA): its prompt token ids without the padding."""
    samples = snapshot.samples
    if snapshot.prompt_token_ids is None:
        prompt_ids = pa.nulls(samples, PROMPT_SCHEMA.field("prompt_token_ids").type)
    else:
        real = np.ones_like(snapshot.prompt_token_ids, bool) if snapshot.prompt_mask is None else snapshot.prompt_mask
        offsets = np.concatenate([[0], np.cumsum(real.sum(axis=1))]).astype(np.int32)
        prompt_ids = pa.ListArray.from_arrays(offsets, snapshot.prompt_token_ids[real])
    return pa.Table.from_arrays(
        [
            np.full(samples, snapshot.step, np.int64),
            np.arange(samples, dtype=np.int32),
            pa.nulls(samples, pa.string()) if snapshot.uid is None else pa.array(snapshot.uid, pa.string()),
            prompt_ids,
            snapshot.lengths.astype(np.int32),
            pa.nulls(samples, pa.bool_()) if snapshot.eos is None else pa.array(snapshot.eos),
            pa.nulls(samples, pa.bool_()) if snapshot.truncated is None else pa.array(snapshot.truncated),
            snapshot.turn_starts.sum(-1, dtype=np.int32),
            _known(snapshot.tool_calls, pa.int32(), samples),
            _known(snapshot.turn_limit, pa.bool_(), samples),
            _bootstrap_values(snapshot),
            pa.array(snapshot.stop_reason if snapshot.stop_reason is not None else [None] * samples, pa.string()),
        ],
        schema=PROMPT_SCHEMA,
    )


def _reason(value: Any) -> str | None:
    """A stop reason as the table stores it: a string, or None (verl fills a missing one with None or NaN)."""
    return value if isinstance(value, str) else None


def _bootstrap_values(snapshot: StepSnapshot) -> pa.Array:
    """V(s_L) on the truncated responses of a bootstrapped step, null on every other one."""
    if snapshot.bootstrap_value is None:
        return pa.nulls(snapshot.samples, pa.float32())
    return pa.array(snapshot.bootstrap_value, pa.float32(), mask=~snapshot.truncated)


def _codes(codes: np.ndarray | None, names: tuple[str, ...], rows: int) -> pa.Array:
    """Strings from their indices into ``names`` (−1: null)."""
    if codes is None:
        return pa.nulls(rows, pa.string())
    indices = pa.array(codes.astype(np.int32), mask=codes < 0)
    return pa.DictionaryArray.from_arrays(indices, pa.array(names)).cast(pa.string())


def _known(values: np.ndarray | None, arrow_type: pa.DataType, samples: int) -> pa.Array:
    """``values`` with −1 as null."""
    if values is None:
        return pa.nulls(samples, arrow_type)
    return pa.array(values, mask=values < 0).cast(arrow_type)


def _agent_turns(records: Sequence[Mapping[str, Any] | None] | None, mask: np.ndarray, lengths: np.ndarray) -> dict:
    """The role codes (N, W), tool calls and turn limits (N,) of the kept samples (the last two only
    with ``records``).

    ``assistant`` wherever the mask is true: verl's response mask marks exactly the tokens the model
    generated. A hole's tokens take the agent loop's record when it covers the response and agrees
    with its mask; otherwise (no record, or one that disagrees) they stay unknown."""
    role = np.where(mask, np.int8(ASSISTANT_CODE), np.int8(-1)).astype(np.int8)
    if records is None:
        return {"role": role}
    kept = mask.shape[0]
    tool_calls = np.full(kept, -1, np.int32)
    turn_limit = np.full(kept, -1, np.int8)
    for row, encoded in enumerate(records[:kept]):
        record = AgentRecord.decode(encoded)
        if record is None:
            continue
        codes = record.role_codes()
        length = int(lengths[row])
        if len(codes) < length or not np.array_equal(codes[:length] == ASSISTANT_CODE, mask[row, :length]) or (codes[:length] < 0).any():
            continue
        role[row, :length] = codes[:length]
        tool_calls[row] = -1 if record.tool_calls is None else record.tool_calls
        turn_limit[row] = -1 if record.turn_limit is None else int(record.turn_limit)
    return {"role": role, "tool_calls": tool_calls, "turn_limit": turn_limit}


def _whitened_mask(capture: StepCapture) -> torch.Tensor:
    """The tokens the estimate whitened over: the recorded statistics must be the ones it used."""
    return capture.mask if capture.truncation is None else capture.truncation.whitened_mask(capture.mask)


def _end_flags(capture: StepCapture, lengths: np.ndarray, token_id: np.ndarray | None) -> dict[str, np.ndarray | None]:
    """How each kept response ended: with an EOS token, cut at max_response_length, or neither; and
    V(s_L) of the cut ones where the estimate bootstrapped from it.

    ``truncated`` is the estimate's own ``cut`` where the step has a truncation: the trace says which
    responses the estimate treated as cut, and ``verl-ext check`` recomputes from that. Without one it
    is the rule of :func:`verl_ext.truncation.cut_responses` (the driver's), from the lengths already at
    hand: that function scans every position, ~50 ms at 512 × 4096 on the training thread."""
    flags: dict[str, np.ndarray | None] = {"eos": None, "truncated": None, "bootstrap_value": None}
    if token_id is not None and capture.eos_token_ids:
        rows = np.arange(len(lengths))
        last = np.where(lengths > 0, token_id[rows, np.maximum(lengths - 1, 0)], -1)
        flags["eos"] = (lengths > 0) & np.isin(last, list(capture.eos_token_ids))
        if capture.max_response_length is not None:
            flags["truncated"] = (lengths == capture.max_response_length) & ~flags["eos"]
    truncation, kept = capture.truncation, len(lengths)
    if truncation is None:
        return flags
    flags["truncated"] = truncation.cut[:kept].detach().to("cpu", torch.bool).numpy()
    if truncation.mode == "bootstrap":
        flags["bootstrap_value"] = truncation.bootstrap_value[:kept].detach().to("cpu", torch.float32).numpy()
    return flags


@dataclass(frozen=True)
class StepFiles:
    """The two tables of one step as ``layout`` stores them, with its run-record entry in the token
    table's footer."""

    step: int
    entry: StepEntry
    tokens: pa.Table
    prompts: pa.Table

    @classmethod
    def build(cls, snapshot: StepSnapshot, layout: Layout = LAYOUT) -> "StepFiles":
        step = snapshot.step
        entry = StepEntry(
            rows=snapshot.rows,
            samples=snapshot.samples,
            batch_samples=snapshot.batch_samples,
            file=layout.token_file(step),
            prompts_file=layout.prompt_file(step),
            written_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            kl_coef=snapshot.kl_coef,
            whiten=snapshot.whiten,
            stored_dtypes=snapshot.stored_dtypes,
        )
        write_id = {WRITE_ID_METADATA_KEY: uuid.uuid4().hex}
        tokens, prompts = layout.stored(token_table(snapshot)), layout.stored(prompt_table(snapshot), prompts=True)
        footer = {STEP_RECORD_METADATA_KEY: json.dumps(dataclasses.asdict(entry))}
        return cls(
            step=step,
            entry=entry,
            tokens=tokens.replace_schema_metadata({**tokens.schema.metadata, **write_id, **footer}),
            prompts=prompts.replace_schema_metadata({**prompts.schema.metadata, **write_id}),
        )


#: The keys of one part (what one loss call reported) besides its per-token columns.
UPDATE_PART_SCALARS = ("epoch", "minibatch", "microbatch", "rank", "batch_num_tokens", "global_batch_size", "dp_size")


@dataclass
class UpdateCapture:
    """One update table of a step: the parts every loss call reported (in any order, from any rank),
    and verl's logged metrics of that update.

    Each part is ``{"epoch": e, "minibatch": k, "microbatch": m, "rank": r, "batch_num_tokens": N_ek,
    "global_batch_size": G, "dp_size": D, "columns": {column: (n,) array}}``, the columns named as in
    the update schema of ``kind`` (at least ``sample`` and ``token_index``); absent columns are null.
    """

    step: int
    kind: str  # "actor" | "critic"
    parts: list[Mapping[str, Any]]
    logged: dict[str, float]


@dataclass(frozen=True)
class UpdateFiles:
    step: int
    kind: str
    entry: UpdateEntry
    table: pa.Table

    @classmethod
    def build(cls, capture: UpdateCapture, max_samples: int | None, layout: Layout = LAYOUT) -> "UpdateFiles":
        """The table sorted by (epoch, sample, token_index), as ``layout`` stores it; samples past
        ``max_samples`` are left out, as in the token table. A column some part did not report is null."""
        schema = UPDATE_SCHEMAS[capture.kind]
        kept = []
        for part in capture.parts:
            sample = np.asarray(part["columns"]["sample"])
            keep = (sample >= 0) & (sample < (max_samples if max_samples is not None else np.iinfo(np.int64).max))
            kept.append((part, keep))

        def column(field: pa.Field) -> pa.Array:
            if field.name == "step":
                return pa.array(np.full(sum(int(keep.sum()) for _, keep in kept), capture.step, np.int64))
            if field.name in UPDATE_PART_SCALARS:
                pieces = [np.full(int(keep.sum()), part[field.name], np.int32) for part, keep in kept]
            elif all(part["columns"].get(field.name) is not None for part, _ in kept):
                pieces = [np.asarray(part["columns"][field.name])[keep] for part, keep in kept]
            else:
                return pa.nulls(sum(int(keep.sum()) for _, keep in kept), field.type)
            return pa.array(np.concatenate(pieces) if pieces else [], field.type)

        table = pa.Table.from_arrays([column(field) for field in schema], schema=schema)
        order = np.lexsort((table["token_index"].to_numpy(), table["sample"].to_numpy(), table["epoch"].to_numpy()))
        table = table.take(order)
        minibatches = {
            (int(part["epoch"]), int(part["minibatch"])): {
                "epoch": int(part["epoch"]),
                "minibatch": int(part["minibatch"]),
                **{name: part.get(name) for name in ("batch_num_tokens", "global_batch_size", "dp_size")},
            }
            for part in capture.parts
        }
        entry = UpdateEntry(
            kind=capture.kind,
            rows=table.num_rows,
            file=layout.update_file(capture.kind, capture.step),
            written_at=datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
            logged=dict(capture.logged),
            minibatches=[minibatches[key] for key in sorted(minibatches)],
        )
        footer = {UPDATE_RECORD_METADATA_KEY: json.dumps(dataclasses.asdict(entry))}
        table = layout.stored(table.replace_schema_metadata({**schema.metadata, **footer}))
        return cls(capture.step, capture.kind, entry, table)


def _check(capture: StepCapture) -> None:
    mask = capture.mask
    if mask.dim() != 2 or mask.shape[0] < 1:
        raise ValueError(f"mask must be (B, T) with B >= 1, got shape {tuple(mask.shape)}")
    unknown = sorted(set(capture.floats) - set(FLOAT_COLUMN_NAMES))
    if unknown:
        raise ValueError(f"unknown float column(s) {', '.join(unknown)}; the float columns are {', '.join(FLOAT_COLUMN_NAMES)}")
    if isinstance(capture.step, bool) or not isinstance(capture.step, numbers.Integral) or capture.step < 0:
        raise ValueError(f"step must be an integer >= 0, got {capture.step!r}")
    for name, tensor in (("token_id", capture.token_id), *capture.floats.items()):
        if tensor is not None and tensor.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, mask has {tuple(mask.shape)}")
    if capture.uid is not None and len(capture.uid) != mask.shape[0]:
        raise ValueError(f"uid has {len(capture.uid)} entries for a batch of {mask.shape[0]}")
    truncation = capture.truncation
    if truncation is not None:
        for name, tensor in (("truncation.cut", truncation.cut), ("truncation.bootstrap_value", truncation.bootstrap_value)):
            if tensor is not None and tuple(tensor.shape) != (mask.shape[0],):
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected ({mask.shape[0]},): one per sample")
    prompts, prompt_mask = capture.prompts, capture.prompt_mask
    if prompts is not None and (prompts.dim() != 2 or prompts.shape[0] != mask.shape[0]):
        raise ValueError(f"prompts must be (B={mask.shape[0]}, P), got shape {tuple(prompts.shape)}")
    if prompt_mask is not None and (prompts is None or prompt_mask.shape != prompts.shape):
        shape = None if prompts is None else tuple(prompts.shape)
        raise ValueError(f"prompt_mask has shape {tuple(prompt_mask.shape)}, prompts has {shape}")


def _row_counts(mask: torch.Tensor) -> torch.Tensor:
    """(N, T) mask -> (N,) int64 on the CPU: last valid position + 1, 0 for a row without one."""
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    return torch.where(mask.bool(), positions, 0).amax(dim=1).cpu()


_ALIGNMENT = 64  # bytes; keeps every array of a block aligned for vectorized copies


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


def _bytes(arrays: dict[str, tuple[torch.Tensor | None, torch.dtype]], shape: tuple[int, int] | None) -> int:
    """Block bytes for the present ``arrays`` at (rows, columns) ``shape``."""
    return sum(_aligned(shape[0] * shape[1] * dtype.itemsize) for tensor, dtype in arrays.values() if tensor is not None)


class _Block:
    """Carves consecutive arrays out of one uint8 block."""

    def __init__(self, memory: torch.Tensor):
        self.memory = memory
        self._used = 0

    def copy(self, tensor: torch.Tensor | None, shape: tuple[int, int] | None, dtype: torch.dtype) -> np.ndarray | None:
        """``tensor[:rows, :cols]`` converted to ``dtype``, copied into the block, as a numpy array."""
        if tensor is None:
            return None
        rows, cols = shape
        nbytes = rows * cols * dtype.itemsize
        array = self.memory[self._used : self._used + nbytes].view(dtype).view(rows, cols)
        self._used += _aligned(nbytes)
        return array.copy_(tensor[:rows, :cols]).numpy()

"""One step's files, made on the writer thread from the training thread's snapshot
(:class:`~verl_ext.trace.capture.StepSnapshot`): :func:`token_table` gathers the positions ``t < L_i``
into the long format of ``TOKEN_SCHEMA``, :func:`prompt_table` builds ``PROMPT_SCHEMA``, and the
step's run-record entry goes into the token file's footer (:class:`StepFiles`). Both tables have
``step``; the trace's :class:`~verl_ext.trace.schema.Layout` says how they are stored and named."""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa

from verl_ext.trace.capture import StepSnapshot
from verl_ext.trace.schema import (
    FLOAT_COLUMN_NAMES,
    LAYOUT,
    PROMPT_SCHEMA,
    ROLE_CODES,
    STEP_RECORD_METADATA_KEY,
    TOKEN_SCHEMA,
    WRITE_ID_METADATA_KEY,
    Layout,
    StepEntry,
)
from verl_ext.turns import turn_index


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
            gather(snapshot.rejected, pa.bool_()),
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
            _known(snapshot.policy_version_min, pa.int32(), samples),
            _known(snapshot.policy_version_max, pa.int32(), samples),
        ],
        schema=PROMPT_SCHEMA,
    )


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
            logged=snapshot.logged,
            global_step=snapshot.global_step,
            substep=snapshot.substep,
            trainer_version=snapshot.trainer_version,
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

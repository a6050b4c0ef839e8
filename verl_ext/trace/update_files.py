"""One update table of a step: what the integration hands over (:class:`UpdateCapture`, the parts the
workers' loss calls reported) and the file made of it on the writer thread (:class:`UpdateFiles`)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from verl_ext.trace.schema import LAYOUT, UPDATE_RECORD_METADATA_KEY, UPDATE_SCHEMAS, Layout, UpdateEntry


#: The keys of one part (what one loss call reported) besides its per-token columns.
UPDATE_PART_SCALARS = ("epoch", "minibatch", "microbatch", "rank", "batch_num_tokens", "global_batch_size", "dp_size")


@dataclass
class UpdateCapture:
    """One update table of a step: the parts every loss call reported (in any order, from any rank),
    and verl's logged metrics of that update.

    Each part is ``{"epoch": e, "minibatch": k, "microbatch": m, "rank": r, "batch_num_tokens": N_ek,
    "global_batch_size": G, "dp_size": D, "valid_tokens": n_all, "columns": {column: (n,) array}}``, the
    columns named as in the update schema of ``kind`` (at least ``sample`` and ``token_index``); absent
    columns are null. ``valid_tokens``: the loss call's valid tokens, traced or not (absent: unknown).
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
            empty_microbatches=sorted(
                [int(part[name]) for name in ("epoch", "minibatch", "microbatch", "rank")]
                for part in capture.parts if part.get("valid_tokens") == 0
            ),
        )
        footer = {UPDATE_RECORD_METADATA_KEY: json.dumps(dataclasses.asdict(entry))}
        table = layout.stored(table.replace_schema_metadata({**schema.metadata, **footer}))
        return cls(capture.step, capture.kind, entry, table)

"""The per-token table of one sample, as the seed dialogues draw it by hand.

Columns: t (token_index), token_id, token (decoded), mask, score, kl, reward, value, delta,
return, advantage_raw, advantage. ``delta`` is the TD residual δ_t = r_t + γ·V_{t+1} − V_t on the
sample's valid tokens (V of the next valid token, 0 after the last one); it is null on masked
tokens and when the run has no values. Every other number is the trace's, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from verl_ext.errors import UsageError
from verl_ext.estimators import td0_returns
from verl_ext.inspect.recorded import RecordedAlgorithm
from verl_ext.trace.reader import listing
from verl_ext.inspect.source import as_trace
from verl_ext.inspect.tokens import decoder_for


@dataclass(frozen=True)
class SampleView:
    """One sample of one step: its token table and decoded prompt and response."""

    step: int
    sample: int
    uid: str | None
    table: pa.Table  # the columns of the module docstring, one row per position
    prompt_text: str | None  # None without a tokenizer or prompt ids
    response_text: str | None
    prompt_token_ids: list[int] | None

    @property
    def valid_tokens(self) -> int:
        return int(pc.sum(self.table.column("mask")).as_py() or 0)


def sample_view(trace, step: int, sample: int, tokenizer=None) -> SampleView:
    """The per-token table of ``sample`` at ``step`` (UsageError when either is not in the trace).

    ``tokenizer``: a TokenDecoder, a Hugging Face tokenizer or a path; default the run record's.
    """
    trace = as_trace(trace)
    trace.require_step(step)
    decoder = decoder_for(trace, tokenizer)
    tokens = trace.read_step(step)
    rows = tokens.filter(pc.equal(tokens.column("sample"), sample))
    if rows.num_rows == 0:
        traced = pc.unique(tokens.column("sample")).to_pylist()
        raise UsageError(f"step {step} has no sample {sample} (traced samples: {listing(sorted(traced))})")
    gamma = RecordedAlgorithm.from_record(trace.record).gamma
    token_ids = rows.column("token_id").to_pylist()
    pieces = decoder.pieces(token_ids) if None not in token_ids else ["?"] * rows.num_rows
    mask = rows.column("mask").to_numpy(zero_copy_only=False)
    table = pa.table(
        {
            "t": rows.column("token_index"),
            "token_id": rows.column("token_id"),
            "token": pa.array(pieces, pa.string()),
            "mask": rows.column("mask"),
            **{name: rows.column(name) for name in ("score", "kl", "reward", "value")},
            "delta": _td_residual(rows, mask, gamma),
            **{name: rows.column(name) for name in ("return", "advantage_raw", "advantage")},
        }
    )
    prompt_ids = _prompt_ids(trace, step, sample)
    valid_ids = [i for i, valid in zip(token_ids, mask) if valid and i is not None]
    return SampleView(
        step=step,
        sample=sample,
        uid=rows.column("uid")[0].as_py(),
        table=table,
        prompt_text=decoder.text(prompt_ids) if prompt_ids is not None else None,
        response_text=decoder.text(valid_ids),
        prompt_token_ids=prompt_ids,
    )


def _td_residual(rows: pa.Table, mask: np.ndarray, gamma: float) -> pa.Array:
    reward, value = rows.column("reward"), rows.column("value")
    if reward.null_count == len(reward) or value.null_count == len(value):
        return pa.nulls(rows.num_rows, pa.float32())
    r = torch.from_numpy(reward.to_numpy().astype(np.float64)).unsqueeze(0)
    v = torch.from_numpy(value.to_numpy().astype(np.float64)).unsqueeze(0)
    m = torch.from_numpy(mask).unsqueeze(0)
    delta = (td0_returns(r, v, m, gamma) - v)[0].numpy()  # td0 raw advantage = δ
    return pa.array(delta.astype(np.float32), pa.float32(), mask=~mask)


def _prompt_ids(trace, step: int, sample: int) -> list[int] | None:
    prompts = trace.prompts(step)
    rows = prompts.filter(pc.equal(prompts.column("sample"), sample))
    return rows.column("prompt_token_ids")[0].as_py() if rows.num_rows else None

"""The per-token table of one sample, as the seed dialogues draw it by hand, with decoded tokens.

The decoded response shows the tokens the policy did not write (mask 0 inside it: a tool's answer)
inline, between ⟦ and ⟧. Columns: t (token_index), token_id, token (decoded), mask, turn and role
(only for a response of several assistant turns: the trace's ``turn`` and ``role``), score, kl, reward, value, delta, return, advantage_raw,
advantage, and where the run has them the off-policy columns (docs/definitions.md#off-policy-tokens):
``log_ratio`` = old_log_prob − rollout_log_prob (ℓ_t, the trainer's against the rollout engine's),
``is_weight`` (verl's importance weight) and ``rejected`` (verl's rejection took the token out of the
mask). ``delta`` is the TD residual δ_t = r_t + γ·V_{t+1} − V_t on the
sample's valid tokens (V of the next valid token, 0 after the last one); it is null on masked
tokens and when the run has no values. Every other number is the trace's, unchanged.

With ``epoch`` the update of that PPO epoch is added from the update tables (docs/definitions.md
§8): minibatch, log_prob, ratio, clip, pg_loss (the actor's), vpred, vf_loss (the critic's).

Decoding (:class:`TokenDecoder`): Token ids to the text a person reads.

The tokenizer is loaded from local files only (``local_files_only=True``: never the network), from
the run record's ``tokenizer_path`` or a path the user gives; without one, tokens show as ``#id``.

Per-token text: each id is decoded on its own. A byte-level tokenizer may split one character
(often a CJK character: three UTF-8 bytes) over several tokens, each of which alone decodes to
U+FFFD; such a run is decoded together, the character is shown on the run's first token and the
following tokens show :data:`CONTINUATION`. Invisible characters are escaped (``\\n``, ``␣``).
"""

from __future__ import annotations

import itertools
import unicodedata
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from verl_ext import estimators
from verl_ext.errors import UsageError, one_line
from verl_ext.steps.layout import as_trace, join_keys, locate
from verl_ext.steps.recorded import RecordedAlgorithm
from verl_ext.steps.update_rows import UpdateRows
from verl_ext.trace.reader import listing


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
    #: where the step sits in an asynchronous run and the response's policy versions (docs/definitions.md#policy-versions),
    #: one line; None for a synchronous run's step
    versions: str | None = None

    @property
    def valid_tokens(self) -> int:
        return int(pc.sum(self.table.column("mask")).as_py() or 0)

    def header(self, algorithm: RecordedAlgorithm) -> list[str]:
        """What the table is: step, sample, uid, token counts, the run's algorithm, and the decoded
        prompt and response when there is a tokenizer."""
        lines = [
            f"step {self.step} · sample {self.sample} · uid {self.uid} · {self.table.num_rows} tokens "
            f"({self.valid_tokens} valid) · {algorithm.describe()}"
        ]
        if self.versions is not None:
            lines.append(f"versions: {self.versions}")
        if self.prompt_text is not None:
            lines.append(f"prompt:   {visible(self.prompt_text, show_spaces=False)}")
        if self.response_text is not None:
            lines.append(f"response: {visible(self.response_text, show_spaces=False)}")
        return lines


def first_sample_with_tool_call(trace, step: int) -> int:
    """The first sample of ``step`` whose response called a tool: a tool's message is in it (the prompt
    table's ``tool_calls`` ≥ 1, as verl's agent loop merged them, docs/definitions.md §7). UsageError,
    one line, when no response of the step did, or the trace does not record tool calls."""
    trace = as_trace(trace)
    trace.require_step(step)
    prompts = trace.prompts(step)
    calls = prompts.column("tool_calls")
    if calls.null_count == len(calls):
        raise UsageError(
            f"step {step} records no tool calls: no agent loop said how many (a run without tools, or a trace before format 5)"
        )
    samples = prompts.column("sample").to_pylist()
    called = [sample for sample, count in zip(samples, calls.to_pylist()) if count]
    if not called:
        raise UsageError(f"no response of step {step} called a tool (0 tool calls in its {len(samples)} responses)")
    return min(called)


#: Update-table columns ``sample_view(..., epoch=e)`` adds, by kind.
UPDATE_COLUMNS = {"actor": ("minibatch", "log_prob", "ratio", "clip", "pg_loss"), "critic": ("vpred", "vf_loss")}


def sample_view(trace, step: int, sample: int, tokenizer=None, epoch: int | None = None) -> SampleView:
    """The per-token table of ``sample`` at ``step`` (UsageError when either is not in the trace).

    ``tokenizer``: a TokenDecoder, a Hugging Face tokenizer or a path; default the run record's.
    ``epoch``: add the update of that PPO epoch (the trace's update tables).
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
    # the per-turn rewards' columns where the run placed them (verl_ext.turn_rewards)
    turn_rewards = [name for name in ("turn_score", "tool_reward") if rows.column(name).null_count < rows.num_rows]
    table = pa.table(
        {
            "t": rows.column("token_index"),
            "token_id": rows.column("token_id"),
            "token": pa.array(pieces, pa.string()),
            "mask": rows.column("mask"),
            **({"turn": rows.column("turn"), "role": rows.column("role")} if (pc.max(rows.column("turn")).as_py() or 0) > 0 else {}),
            **{name: rows.column(name) for name in ("score", *turn_rewards, "kl", "reward", "value")},
            "delta": _td_residual(rows, mask, gamma),
            **{name: rows.column(name) for name in ("return", "advantage_raw", "advantage")},
            **_offpolicy_columns(rows),
        }
    )
    if epoch is not None:
        table = _with_update(trace, step, sample, epoch, table)
    prompt_ids = _prompt_ids(trace, step, sample)
    return SampleView(
        step=step,
        sample=sample,
        uid=rows.column("uid")[0].as_py(),
        table=table,
        prompt_text=decoder.text(prompt_ids) if prompt_ids is not None else None,
        response_text=_response_text(decoder, token_ids, _own(rows, mask)),
        prompt_token_ids=prompt_ids,
        versions=versions_line(trace, step, sample),
    )


def versions_line(trace, step: int, sample: int) -> str | None:
    """``verl step 2, update 2 of 2, trainer version 2 · policy version 1 (staleness 1)``: the step's place in an
    asynchronous run and the response's policy versions; None for a synchronous run's step."""
    from verl_ext.steps.versions import StepVersions, may_be_asynchronous

    if not may_be_asynchronous(trace.record):
        return None
    versions = StepVersions.read(trace, step)
    place = versions.place.describe()
    if place is None:
        return None
    at = {name: values[0] for name, values in versions.at(np.array([sample])).items()}
    low, high, staleness = at["version_min"], at["version_max"], at["staleness"]
    if not np.isfinite(low):
        return f"{place} · policy version not recorded (the rollout did not say)"
    if np.isfinite(high) and high > low:
        text = f"policy versions {low:.0f}–{high:.0f} (its generation spanned a weight update"
        return f"{place} · {text}" + (f"; staleness {staleness:.0f})" if np.isfinite(staleness) else ")")
    return f"{place} · policy version {low:.0f}" + (f" (staleness {staleness:.0f})" if np.isfinite(staleness) else "")


def _offpolicy_columns(rows: pa.Table) -> dict[str, pa.Array]:
    """``log_ratio``, ``is_weight`` and ``rejected`` (module docstring), each where the run has it."""
    columns = {}
    old, rollout = rows.column("old_log_prob"), rows.column("rollout_log_prob")
    if old.null_count < len(old) and rollout.null_count < len(rollout):
        columns["log_ratio"] = pc.subtract(old, rollout)
    if rows.column("rollout_is_weight").null_count < rows.num_rows:
        columns["is_weight"] = rows.column("rollout_is_weight")
    if pc.any(rows.column("rejected")).as_py():  # verl's correction runs on every step with rollout log-probs
        columns["rejected"] = rows.column("rejected")
    return columns


def _own(rows: pa.Table, mask: np.ndarray) -> np.ndarray:
    """The tokens the policy wrote: the valid ones and those verl's rejection took out of the mask."""
    rejected = rows.column("rejected")
    return mask if rejected.null_count == len(rejected) else mask | rejected.fill_null(False).to_numpy(zero_copy_only=False)


#: Around the tokens of a response the policy did not write (mask 0 inside it: a tool's answer).
NOT_WRITTEN = ("⟦", "⟧")


def _response_text(decoder, token_ids: list, mask: np.ndarray) -> str | None:
    """The response decoded; runs of tokens the policy did not write inline, between :data:`NOT_WRITTEN`."""
    if not decoder.available:
        return None
    pieces = []
    for written, run in itertools.groupby(zip(token_ids, mask.tolist()), key=lambda pair: bool(pair[1])):
        text = decoder.text([token_id for token_id, _ in run if token_id is not None])
        pieces.append(text if written else NOT_WRITTEN[0] + text + NOT_WRITTEN[1])
    return "".join(pieces)


def _with_update(trace, step: int, sample: int, epoch: int, table: pa.Table) -> pa.Table:
    """``table`` with the update columns of ``epoch`` at its token positions (null where not trained)."""
    added = 0
    for kind, names in UPDATE_COLUMNS.items():
        if step not in trace.update_steps.get(kind, []):
            continue
        update = UpdateRows.read(trace, kind, step)
        rows = update.table.take(pa.array(update.of([sample], epoch), pa.int64()))
        positions = table["t"].to_numpy()
        index, found = locate(join_keys(rows["sample"].to_numpy(), rows["token_index"].to_numpy()), join_keys(np.full(len(positions), sample), positions))
        order = pa.array(index, pa.int64(), mask=~found)  # null where the token was not trained
        for name in names:
            table = table.append_column(name, rows[name].take(order))
        added += rows.num_rows
    if not added:
        epochs = sorted({e for kind in UPDATE_COLUMNS for e in _epochs(trace, kind, step)})
        raise UsageError(f"step {step} has no update rows of sample {sample} in epoch {epoch} (epochs traced: {listing(epochs)})")
    return table


def _epochs(trace, kind: str, step: int) -> list[int]:
    if step not in trace.update_steps.get(kind, []):
        return []
    table = trace.update_table(kind, step, ["epoch"])
    return pc.unique(table["epoch"]).to_pylist()


def _td_residual(rows: pa.Table, mask: np.ndarray, gamma: float) -> pa.Array:
    reward, value = rows.column("reward"), rows.column("value")
    if reward.null_count == len(reward) or value.null_count == len(value):
        return pa.nulls(rows.num_rows, pa.float32())
    r = torch.from_numpy(reward.to_numpy().astype(np.float64)).unsqueeze(0)
    v = torch.from_numpy(value.to_numpy().astype(np.float64)).unsqueeze(0)
    m = torch.from_numpy(mask).unsqueeze(0)
    delta = estimators.td0(r, v, m, gamma)[1][0].numpy()  # the td0 advantage is δ_t
    return pa.array(delta.astype(np.float32), pa.float32(), mask=~mask)


def _prompt_ids(trace, step: int, sample: int) -> list[int] | None:
    prompts = trace.prompts(step)
    rows = prompts.filter(pc.equal(prompts.column("sample"), sample))
    return rows.column("prompt_token_ids")[0].as_py() if rows.num_rows else None


# --------------------------------------------------------------------------- decoding

#: Shown for a token that only carries the remaining bytes of the previous token's character.
CONTINUATION = "<+>"
#: Shown for a token that decodes to nothing.
EMPTY = "∅"
_REPLACEMENT = "\ufffd"
_MAX_BYTES_PER_CHARACTER = 4
_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def visible(text: str, show_spaces: bool = True) -> str:
    """``text`` with line breaks, tabs and other control characters escaped (spaces as ␣ if asked)."""
    out = []
    for ch in text:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch == " " and show_spaces:
            out.append("␣")
        elif unicodedata.category(ch) in ("Cc", "Cf") and ch != " ":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


class TokenDecoder:
    """Decodes token ids with a Hugging Face tokenizer, or shows ids when there is none."""

    def __init__(self, tokenizer=None, source: str | None = None, problem: str | None = None):
        self.tokenizer = tokenizer
        self.source = source
        #: Why there is no tokenizer (None when there is one).
        self.problem = problem
        self._single: dict[int, str] = {}  # id -> its text decoded alone (a page decodes many samples)

    @classmethod
    def load(cls, path: str | None) -> "TokenDecoder":
        """Load ``AutoTokenizer.from_pretrained(path, local_files_only=True)``; on any failure a
        decoder that shows ids, with ``problem`` saying why."""
        if not path:
            return cls(problem="no tokenizer: the run record names none and none was given")
        try:
            from transformers import AutoTokenizer
            from transformers.utils import logging as hf_logging

            verbosity = hf_logging.get_verbosity()
            hf_logging.set_verbosity_error()  # its own warnings would break the one-line contract
            try:
                tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            finally:
                hf_logging.set_verbosity(verbosity)
        except Exception as exc:  # noqa: BLE001 - any failure means the same thing: show ids
            return cls(problem=f"cannot load tokenizer {path} ({one_line(exc)[:160]})")
        return cls(tokenizer, source=path)

    @property
    def available(self) -> bool:
        return self.tokenizer is not None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def text(self, ids: Sequence[int]) -> str | None:
        """The decoded text of ``ids``; None without a tokenizer."""
        return self._decode(ids) if self.available else None

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """One display string per token (see the module docstring)."""
        ids = [int(i) for i in ids]
        if not self.available:
            return [f"#{i}" for i in ids]
        out: list[str] = []
        i = 0
        while i < len(ids):
            text = self._single.get(ids[i])
            if text is None:
                text = self._single[ids[i]] = self._decode(ids[i : i + 1])
            run = 1
            if _REPLACEMENT in text:
                for length in range(2, min(_MAX_BYTES_PER_CHARACTER, len(ids) - i) + 1):
                    joined = self._decode(ids[i : i + length])
                    if _REPLACEMENT not in joined:
                        text, run = joined, length
                        break
            out.append(visible(text) if text else EMPTY)
            out.extend([CONTINUATION] * (run - 1))
            i += run
        return out


def decoder_for(trace, tokenizer=None) -> TokenDecoder:
    """The decoder to use: ``tokenizer`` as given (a TokenDecoder, a Hugging Face tokenizer or a
    path), else the run record's ``tokenizer_path``."""
    if isinstance(tokenizer, TokenDecoder):
        return tokenizer
    if tokenizer is None or isinstance(tokenizer, str):
        return TokenDecoder.load(tokenizer or trace.record.tokenizer_path)
    return TokenDecoder(tokenizer, source=getattr(tokenizer, "name_or_path", None))

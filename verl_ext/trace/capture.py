"""What the trainer hands the trace for one step (:class:`StepCapture`), and the training thread's copy
of it (:func:`take_snapshot`).

:func:`take_snapshot` runs on the training thread when a step is submitted. It does the least work
that makes the trace independent of the trainer's tensors, which the trainer may reuse or modify
in place once the hook returns: it checks shapes (B, T), reduces the mask to each sample's row count
L_i (last valid position + 1), and copies rows 0 … N − 1 and columns 0 … max L_i − 1 of every tensor
into CPU memory recycled from written steps (:mod:`verl_ext.trace.snapshot_memory`), converting to the
schema's dtypes in the same pass (float32, int32, bool). It computes nothing: the whitening statistics
come with the capture, from the estimate. The writer thread makes the files
(:mod:`verl_ext.trace.step_files`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from verl_ext.torch_threads import one_torch_thread
from verl_ext.trace.agent_record import ASSISTANT_CODE, AgentRecord
from verl_ext.trace.schema import FLOAT_COLUMN_NAMES
from verl_ext.trace.snapshot_memory import Block, SnapshotMemory, block_bytes
from verl_ext.truncation import Truncation
from verl_ext.turns import turn_starts


@dataclass
class StepCapture:
    """What the integration hands over for one step, right after the advantages are computed.

    Fields are named after the token table's columns. All tensors are (B, T) over the response
    positions unless said otherwise, on any device, of any dtype (bf16, float32, int64, …); a float
    column absent from ``floats`` (or None there) is null in the table. B ≥ 1.
    """

    step: int
    mask: torch.Tensor  # (B, T) 0/1: 1 on trainable response tokens (verl's response_mask, after any rejection)
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
    #: ``truncated`` flag, its ``bootstrap_value`` the column of that name (bootstrap only)
    truncation: Truncation | None = None
    #: the estimate's {"mean", "var"} of advantage_raw over the full batch
    #: (:func:`verl_ext.registry.whitening_statistics`); None where there are none
    whitening: Mapping[str, float] | None = None
    #: (B, T) 0/1: the tokens verl's rollout-correction rejection took out of the response mask (the
    #: policy wrote them; ``mask`` lacks them); None: the run rejects nothing
    rejected: torch.Tensor | None = None
    #: numbers verl logged for the step that the trace must reproduce (its rollout correction's)
    logged: Mapping[str, float] | None = None
    #: B pairs (min, max) of the policy versions that generated each response (verl's min/max_global_steps, in
    #: the run's numbering: docs/definitions.md#policy-versions), None in a pair where unknown; None: none said
    policy_versions: Sequence[tuple[int | None, int | None]] | None = None
    #: verl's own step of this trace step, and which of its updates it is (StepEntry.global_step, .substep),
    #: and the policy version the update starts from (StepEntry.trainer_version); None: not recorded
    global_step: int | None = None
    substep: int | None = None
    trainer_version: int | None = None


@dataclass(frozen=True)
class StepSnapshot:
    """The writer thread's own copy of one step (N samples kept of B, W = max L_i positions)."""

    step: int
    batch_samples: int  # B
    lengths: np.ndarray  # (N,) int64: rows of each sample, L_i = the policy's last token's position + 1 (0: none)
    mask: np.ndarray  # (N, W) bool
    token_id: np.ndarray | None  # (N, W) int32
    rejected: np.ndarray | None  # (N, W) bool: the policy's tokens verl's rejection took out of ``mask``
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
    policy_version_min: np.ndarray | None = None  # (N,) int32, −1 where unknown
    policy_version_max: np.ndarray | None = None  # (N,) int32, −1 where unknown
    global_step: int | None = None  # StepEntry.global_step
    substep: int | None = None  # StepEntry.substep
    trainer_version: int | None = None  # StepEntry.trainer_version
    stored_dtypes: dict[str, str] = field(default_factory=dict)  # StepEntry.stored_dtypes
    logged: dict[str, float] = field(default_factory=dict)  # StepEntry.logged

    @property
    def samples(self) -> int:
        return len(self.lengths)

    @property
    def rows(self) -> int:
        return int(self.lengths.sum())

    @cached_property
    def own(self) -> np.ndarray:
        """(N, W) bool: the tokens the policy wrote, ``mask`` ∨ ``rejected`` (a rejection is not a hole)."""
        return self.mask if self.rejected is None else self.mask | self.rejected

    @cached_property
    def turn_starts(self) -> np.ndarray:
        """(N, W) bool: the first token of every assistant turn (:func:`verl_ext.turns.turn_starts`) of the
        policy's own tokens, for the token table's ``turn`` and the prompt table's ``assistant_turns``."""
        return turn_starts(self.own)


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
        "rejected": (capture.rejected, torch.bool),
        "token_id": (capture.token_id, torch.int32),
        **{name: (capture.floats.get(name), torch.float32) for name in FLOAT_COLUMN_NAMES},
    }
    prompt_arrays = {"prompt_token_ids": (capture.prompts, torch.int32), "prompt_mask": (capture.prompt_mask, torch.bool)}
    prompt_shape = None if capture.prompts is None else (kept, capture.prompts.shape[1])
    # The block is sized for the full length T, not the longest response, so that in a run with a
    # fixed batch shape every recycled block fits every step.
    nbytes = block_bytes(response_arrays, (kept, length)) + block_bytes(prompt_arrays, prompt_shape)
    block = Block((memory or SnapshotMemory()).take(nbytes))
    with one_torch_thread():
        own = capture.mask if capture.rejected is None else capture.mask.bool() | capture.rejected.bool()
        lengths = _row_counts(own[:kept])
        shape = (kept, int(lengths.max()))
        copies = {name: block.copy(tensor, shape, dtype) for name, (tensor, dtype) in response_arrays.items()}
        copies |= {name: block.copy(tensor, prompt_shape, dtype) for name, (tensor, dtype) in prompt_arrays.items()}
        return StepSnapshot(
            step=int(capture.step),
            batch_samples=batch,
            lengths=lengths.numpy(),
            mask=copies["mask"],
            rejected=copies["rejected"],
            token_id=copies["token_id"],
            floats={name: copies[name] for name in FLOAT_COLUMN_NAMES},
            uid=None if capture.uid is None else [str(u) for u in capture.uid[:kept]],
            prompt_token_ids=copies["prompt_token_ids"],
            prompt_mask=copies["prompt_mask"],
            kl_coef=None if capture.kl_coef is None else float(capture.kl_coef),
            whiten=None if capture.whitening is None else {key: float(capture.whitening[key]) for key in ("mean", "var")},
            block=block.memory,
            stored_dtypes={
                name: _LOW_PRECISION[tensor.dtype]
                for name, tensor in capture.floats.items()
                if tensor is not None and tensor.dtype in _LOW_PRECISION
            },
            **_end_flags(capture, lengths.numpy(), copies["token_id"]),
            **_agent_turns(capture.agent_turns, copies["mask"] if copies["rejected"] is None else copies["mask"] | copies["rejected"], lengths.numpy()),
            stop_reason=None if capture.stop_reasons is None else [_reason(r) for r in capture.stop_reasons[:kept]],
            logged={str(key): float(value) for key, value in (capture.logged or {}).items()},
            **_policy_versions(capture.policy_versions, kept),
            global_step=_optional_int(capture.global_step),
            substep=_optional_int(capture.substep),
            trainer_version=_optional_int(capture.trainer_version),
        )


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _policy_versions(pairs: Sequence[tuple[Any, Any]] | None, kept: int) -> dict[str, np.ndarray | None]:
    """The kept samples' (min, max) policy versions as two (N,) int32 arrays, −1 where unknown."""
    if pairs is None:
        return {}
    known = np.array([[-1 if v is None else int(v) for v in pair] for pair in list(pairs)[:kept]], np.int32).reshape(-1, 2)
    return {"policy_version_min": known[:, 0].copy(), "policy_version_max": known[:, 1].copy()}


#: Batch dtypes below float32 and their names in StepEntry.stored_dtypes.
_LOW_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _reason(value: Any) -> str | None:
    """A stop reason as the table stores it: a string, or None (verl fills a missing one with None or NaN)."""
    return value if isinstance(value, str) else None


def _agent_turns(records: Sequence[Mapping[str, Any] | None] | None, mask: np.ndarray, lengths: np.ndarray) -> dict:
    """The role codes (N, W), tool calls and turn limits (N,) of the kept samples (the last two only
    with ``records``).

    ``assistant`` wherever ``mask`` (the policy's own tokens: verl's response mask before any rejection)
    is true: it marks exactly the tokens the model generated. A hole's tokens take the agent loop's record when it covers the response and agrees
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


def _check(capture: StepCapture) -> None:
    mask = capture.mask
    if mask.dim() != 2 or mask.shape[0] < 1:
        raise ValueError(f"mask must be (B, T) with B >= 1, got shape {tuple(mask.shape)}")
    unknown = sorted(set(capture.floats) - set(FLOAT_COLUMN_NAMES))
    if unknown:
        raise ValueError(f"unknown float column(s) {', '.join(unknown)}; the float columns are {', '.join(FLOAT_COLUMN_NAMES)}")
    if isinstance(capture.step, bool) or not isinstance(capture.step, numbers.Integral) or capture.step < 0:
        raise ValueError(f"step must be an integer >= 0, got {capture.step!r}")
    for name, tensor in (("token_id", capture.token_id), ("rejected", capture.rejected), *capture.floats.items()):
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

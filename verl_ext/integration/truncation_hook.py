"""The responses of verl's batch that were cut at ``data.max_response_length``, and V(s_L) after them,
at the advantage step (``algorithm.truncation``, docs/definitions.md #truncated-responses).

The cut is read as the trace reads it (the tokenizer's EOS ids, ``data.max_response_length``), so that the
rows the estimate treated as cut are the rows the trace calls ``truncated``. The legacy trainer's batch
holds the response ids and V(s_L); the V1 trainer's batch at its advantage step holds neither, and the
step reads them from TransferQueue (:func:`v1_fields`).
"""

from __future__ import annotations

from typing import Any

import torch

from verl_ext.options import TRUNCATION, TRUNCATION_DEFAULT, algorithm_settings
from verl_ext.truncation import VALUES_AFTER_LAST, Truncation, cut_responses


def eos_token_ids(trainer: Any) -> tuple[int, ...] | None:
    """What ends a response: the trainer's tokenizer's ``eos_token_id`` (one id or several)."""
    eos = getattr(getattr(trainer, "tokenizer", None), "eos_token_id", None)
    if eos is None:
        return None
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def mode_of(algorithm: Any) -> str:
    """``algorithm.truncation`` of an algorithm config (None: the default)."""
    return TRUNCATION.read(algorithm_settings(algorithm))


def v1_fields(mode: str, available: Any) -> list[str]:
    """What the V1 step reads from TransferQueue for ``mode`` (``available``: the batch's field names,
    None when unknown): the response ids for the cut, V(s_L) for a bootstrap."""
    if mode == TRUNCATION_DEFAULT:
        return []
    wanted = ["responses"] + ([VALUES_AFTER_LAST] if mode == "bootstrap" else [])
    return [name for name in wanted if available is None or name in available]


def truncation_of(data: Any, mode: str, trainer: Any, stored: dict[str, Any], own: torch.Tensor | None = None) -> Truncation | None:
    """The step's :class:`Truncation` (None under ``terminal``: nothing is read). ``data``: verl's batch at
    its advantage step; ``stored``: the V1 step's fields from TransferQueue ({} on the legacy trainer);
    ``own``: the policy's tokens where verl's rollout correction rejected some from the response mask
    (a response whose last tokens were rejected was still cut: docs/definitions.md#off-policy-tokens)."""
    if mode == TRUNCATION_DEFAULT:
        return None
    what = f"algorithm.truncation={mode}"
    if trainer is None:
        raise RuntimeError(f"{what} needs the trainer's tokenizer and data.max_response_length: it applies inside a trainer's fit()")
    eos = eos_token_ids(trainer)
    if not eos:
        raise RuntimeError(
            f"{what} needs the tokenizer's eos_token_id to tell a cut response from one that ended; the trainer's tokenizer has none"
        )
    mask = data.batch["response_mask"]
    responses = _field(data, stored, "responses", what)
    if responses is None:
        raise RuntimeError(f"{what} needs the response token ids (batch key responses) to find the cut responses; the batch has none")
    if responses.shape != mask.shape:
        raise RuntimeError(f"{what}: the response ids {tuple(responses.shape)} do not line up with the response mask {tuple(mask.shape)}")
    cut = cut_responses(responses.to(mask.device), mask if own is None else own.to(mask.device), eos, int(trainer.config.data.max_response_length))
    if mode != "bootstrap":
        return Truncation(mode, cut)
    values_after_last = _field(data, stored, VALUES_AFTER_LAST, what)
    if values_after_last is None:
        raise RuntimeError(
            f"{what} needs V(s_L), the critic's value after each response's last token (batch key {VALUES_AFTER_LAST}), "
            "and the batch has none: the critic did not keep it (verl-ext's critic touch is not in this run; run `verl-ext doctor`)"
        )
    return Truncation(mode, cut, values_after_last.reshape(len(mask)).to(mask.device))


def _field(data: Any, stored: dict[str, Any], key: str, what: str) -> torch.Tensor | None:
    """``key`` from verl's batch, else from the V1 step's read of TransferQueue (padded, one row per sample)."""
    batch = data.batch
    if key in batch.keys():
        return batch[key]
    value = stored.get(key)
    if value is None:
        return None
    value = value.to_padded_tensor(padding=0) if getattr(value, "is_nested", False) else value
    if len(value) != len(batch["response_mask"]):
        # on grpo verl's V1 step estimates on each agent session's last output only (v1/utils.py
        # compute_advantage_for_multi_trajectories), rows verl-ext cannot map back to the stored ones
        raise RuntimeError(
            f"{what}: the advantage step holds {len(batch['response_mask'])} rows and the stored batch {len(value)} "
            "(agent sessions with several outputs, whose rows verl's V1 grpo selects); use algorithm.truncation=terminal "
            "or one output per session"
        )
    return value

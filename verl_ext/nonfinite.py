"""Non-finite numbers on valid tokens: whether a step has any, where, and what they came from.

A NaN value at one token becomes a NaN advantage at that token, and after whitening a NaN
advantage everywhere; by then nothing says where it started. :func:`find` looks at a step's
per-token quantities (verl's batch keys, all (B, T)) and returns a :class:`Finding` when one holds a
NaN or an infinity on a valid token (``response_mask`` non-zero), None otherwise; its
:meth:`Finding.line` is the one line verl-ext prints or raises (verl_ext.integration.nonfinite_hook).

The line names the most downstream quantity that is not finite and, through :data:`UPSTREAM`, the
first quantity upstream of it that already was, with where: a NaN value that made every advantage
NaN is reported as the value at its sample and token.

Cost on a finite step: one sum per checked tensor and one comparison (a NaN or an infinity makes a
sum non-finite); the per-token search runs only when that check fails, also when the culprit is a
masked position or a sum that overflowed (then :func:`find` returns None). No verl import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

#: What each computed quantity is computed from, in the order a cause is looked for (verl's batch
#: keys). Rewards are the scores minus β·KL(old_log_probs ‖ ref_log_prob) when the KL is in the
#: reward; returns and advantages both come from the rewards and the values (verl's GRPO: the rewards
#: alone); verl's rollout-correction weights from the old and the rollout's log-probs. Every other
#: quantity comes straight from verl's workers or its reward.
UPSTREAM: dict[str, tuple[str, ...]] = {
    "advantages": ("token_level_rewards", "values"),
    "returns": ("token_level_rewards", "values"),
    "token_level_rewards": ("token_level_scores", "old_log_probs", "ref_log_prob"),
    "rollout_is_weights": ("old_log_probs", "rollout_log_probs"),
}
#: Read only to name a cause: a non-finite score on a valid token makes the reward there non-finite too.
CAUSE_ONLY = ("token_level_scores",)


def reporting_order(names: Iterable[str]) -> tuple[str, ...]:
    """``names`` most downstream first: the computed quantities (:data:`UPSTREAM`'s order), then the
    others as given, :data:`CAUSE_ONLY` last."""
    names = tuple(names)
    return (
        *(name for name in UPSTREAM if name in names),
        *(name for name in names if name not in UPSTREAM and name not in CAUSE_ONLY),
        *(name for name in CAUSE_ONLY if name in names),
    )


class NonFiniteError(FloatingPointError):
    """``verl_ext.nonfinite=raise``: a step holds a non-finite number on a valid token (the message
    is :meth:`Finding.line`)."""


@dataclass(frozen=True)
class Spot:
    """Where one quantity is not finite: how many valid tokens, and the first of them (row-major)."""

    quantity: str
    count: int
    row: int
    token: int
    value: float

    def where(self, uid: Sequence[Any] | None) -> str:
        uid_text = f"uid {uid[self.row]}" if uid is not None and self.row < len(uid) else "uid ?"
        return f"sample {self.row} ({uid_text}), token {self.token}"


@dataclass(frozen=True)
class Finding:
    """The non-finite quantities of one step (:func:`reporting_order`) and the number of valid tokens."""

    spots: dict[str, Spot]
    valid_tokens: int

    @property
    def reported(self) -> Spot:
        """The most downstream non-finite quantity (:func:`find` reports no finding for a non-finite
        :data:`CAUSE_ONLY` quantity alone)."""
        return next(iter(self.spots.values()))

    def cause(self, quantity: str | None = None) -> tuple[Spot, ...]:
        """The chain from ``quantity`` (default: :attr:`reported`) to the first non-finite quantity
        upstream of it, following the first non-finite upstream quantity at each link; the chain is
        just ``quantity`` when nothing upstream of it is non-finite."""
        chain = [self.spots[quantity or self.reported.quantity]]
        while True:
            upstream = next((u for u in UPSTREAM.get(chain[-1].quantity, ()) if u in self.spots), None)
            if upstream is None or any(spot.quantity == upstream for spot in chain):
                return tuple(chain)
            chain.append(self.spots[upstream])

    def line(self, step: int | None, uid: Sequence[Any] | None = None) -> str:
        """One line: the step, the reported quantity, the first non-finite quantity upstream of it
        with its sample (row and uid) and token, and every other non-finite quantity."""
        head, *links = self.cause()
        text = (
            f"verl-ext: step {'?' if step is None else step}: {head.quantity} not finite on {head.count} of "
            f"{self.valid_tokens} valid tokens, first {_value(head.value)} at {head.where(uid)}"
        )
        if links:
            origin = links[-1]
            via = f" (via {', '.join(spot.quantity for spot in links[:-1])})" if len(links) > 1 else ""
            text += (
                f"; first non-finite upstream: {origin.quantity}{via}, {_value(origin.value)} at {origin.where(uid)}"
                f" ({origin.count} valid token{'s' if origin.count != 1 else ''})"
            )
        else:
            text += "; nothing upstream of it is non-finite"
        named = {head.quantity, *(spot.quantity for spot in links)}
        others = [spot for name, spot in self.spots.items() if name not in named]
        if others:
            text += "; also not finite: " + ", ".join(
                f"{spot.quantity} ({spot.count} valid token{'s' if spot.count != 1 else ''}, first {_value(spot.value)} "
                f"at {spot.where(uid)})"
                for spot in others
            )
        return text


def find(quantities: Mapping[str, torch.Tensor | None], response_mask: torch.Tensor) -> Finding | None:
    """The non-finite numbers on valid tokens of ``quantities`` ({verl batch key: (B, T) tensor or
    None}; None, non-float tensors and tensors of another shape are ignored; every other one is
    checked but :data:`CAUSE_ONLY`), or None when there is none. Fast when there is none (module docstring)."""
    tensors = {
        name: quantities[name]
        for name in reporting_order(quantities)
        if isinstance(quantities.get(name), torch.Tensor)
        and quantities[name].is_floating_point()
        and quantities[name].shape == response_mask.shape
    }
    if all_finite([tensor for name, tensor in tensors.items() if name not in CAUSE_ONLY]):
        return None
    valid = response_mask != 0
    spots = {}
    for name, tensor in tensors.items():
        bad = ~torch.isfinite(tensor) & valid
        count = int(bad.sum())
        if count:
            first = int(bad.view(-1).nonzero()[0])  # row-major: the first sample, then its first token
            row, token = divmod(first, tensor.shape[1])
            spots[name] = Spot(name, count, row, token, float(tensor[row, token]))
    if all(name in CAUSE_ONLY for name in spots):
        return None  # a non-finite number at a masked position, or a sum that overflowed
    return Finding(spots, int(valid.sum()))


def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite: one sum per distinct tensor (NaN and ±inf
    make a sum non-finite), one comparison, one synchronisation. A sum that overflows says False."""
    seen, sums = set(), []
    for tensor in tensors:
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if key in seen:  # verl hands over the same tensor under two names (rewards = scores, returns = advantages)
            continue
        seen.add(key)
        exact = tensor.dtype in (torch.float32, torch.float64)
        sums.append(tensor.sum() if exact else tensor.sum(dtype=torch.float32))  # half types: no overflow at 65504
    if not sums:
        return True
    return bool(torch.stack([s.to(sums[0].device, torch.float64) for s in sums]).isfinite().all())


def _value(value: float) -> str:
    return "nan" if value != value else ("inf" if value > 0 else "-inf")

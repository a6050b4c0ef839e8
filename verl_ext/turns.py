"""Assistant turns (docs/definitions.md §7, "Turns"): where each turn starts, where it ends, and
which turn every position is in.

An assistant turn is a maximal run of the policy's tokens (the valid ones, and those verl's rollout
correction rejected: a rejection is not a hole); the runs between turns are holes, and masked tokens
before the first turn or after the last one start nothing. These four functions are
the one definition of the turns: the estimators' kernels and the per-turn rewards call them on torch
tensors, the trace capture, the inspection and the step metrics on numpy arrays. Each is written
with operations that numpy arrays and torch tensors share (slices, comparisons, cumsum), so one
formula serves both without a conversion, on any device; nothing is imported here, so reading a
trace still does not load torch.
"""

from __future__ import annotations


def turn_starts(mask):
    """s_t = m_t ∧ ¬m_{t−1} (m_{−1} = 0, m: the mask is non-zero): a (…, T) mask gives (…, T) bool."""
    starts = mask != 0
    # the right side is evaluated from the unchanged mask before it is written back
    starts[..., 1:] = starts[..., 1:] > starts[..., :-1]
    return starts


def turn_ends(mask):
    """e_t = m_t ∧ ¬m_{t+1} (m_T = 0, m: the mask is non-zero): a (…, T) mask gives (…, T) bool."""
    ends = mask != 0
    ends[..., :-1] = ends[..., :-1] > ends[..., 1:]
    return ends


def turn_index(starts):
    """k_t = Σ_{u≤t} s_u − 1, the turn of position t (−1 before the first turn; a hole keeps the turn
    before it): (…, T) turn starts give (…, T) int64."""
    index = starts.cumsum(-1)
    index -= 1
    return index


def first_of_each_turn(sample, turn):
    """f_i = (b_i ≠ b_{i−1}) ∨ (k_i ≠ k_{i−1}), f_0 = true: over the valid tokens in (sample, position)
    order, with their samples b and turns k (of the policy's tokens), the first valid token of each
    turn, which is its first token unless verl's rejection took that one out: (N,) and (N,) give (N,) bool."""
    first = sample == sample
    first[1:] = (sample[1:] != sample[:-1]) | (turn[1:] != turn[:-1])
    return first

"""Assistant turns (docs/definitions.md §7, "Turns"): where each turn starts, where it ends, and
which turn every position is in.

An assistant turn is a maximal run of valid tokens; the masked runs between turns are holes, and
masked tokens before the first turn or after the last one start nothing. These three functions are
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

"""Independent reference implementations of DEFINITIONS.md §3, written as the direct sums.

Deliberately naive: float64 numpy, explicit loops over the compacted sequence, no recursion and
no code shared with verl_ext. Tests compare verl_ext against these on valid positions.
"""

from __future__ import annotations

import numpy as np


def valid_positions(mask_row) -> np.ndarray:
    return np.flatnonzero(np.asarray(mask_row) != 0)


def _per_row(fn, rewards, values, mask, *args):
    rewards = np.asarray(rewards, dtype=np.float64)
    values = None if values is None else np.asarray(values, dtype=np.float64)
    out = np.full(rewards.shape, np.nan)
    for b in range(rewards.shape[0]):
        idx = valid_positions(mask[b])
        r = rewards[b, idx]
        v = None if values is None else values[b, idx]
        out[b, idx] = fn(r, v, *[a[b] if isinstance(a, np.ndarray) else a for a in args])
    return out


def _mc(r, _v, gamma):
    L = len(r)
    return np.array([sum(gamma ** (k - t) * r[k] for k in range(t, L)) for t in range(L)])


def _nstep(r, v, gamma, n):
    L = len(r)
    out = []
    for t in range(L):
        g = sum(gamma ** (k - t) * r[k] for k in range(t, min(t + n, L)))
        if t + n < L:
            g += gamma**n * v[t + n]
        out.append(g)
    return np.array(out)


def _td0(r, v, gamma):
    L = len(r)
    return np.array([r[t] + (gamma * v[t + 1] if t + 1 < L else 0.0) for t in range(L)])


def _deltas(r, v, gamma):
    L = len(r)
    return np.array([r[t] + (gamma * v[t + 1] if t + 1 < L else 0.0) - v[t] for t in range(L)])


def _gae(r, v, gamma, lam):
    d = _deltas(r, v, gamma)
    L = len(r)
    return np.array([sum((gamma * lam) ** (k - t) * d[k] for k in range(t, L)) for t in range(L)])


def mc_returns(rewards, mask, gamma):
    return _per_row(_mc, rewards, None, mask, gamma)


def td0_returns(rewards, values, mask, gamma):
    return _per_row(_td0, rewards, values, mask, gamma)


def nstep_returns(rewards, values, mask, gamma, n):
    return _per_row(_nstep, rewards, values, mask, gamma, n)


def deltas(rewards, values, mask, gamma):
    return _per_row(_deltas, rewards, values, mask, gamma)


def gae_advantages(rewards, values, mask, gamma, lam):
    """lam: a float or an array with one λ per row."""
    return _per_row(_gae, rewards, values, mask, gamma, lam if np.isscalar(lam) else np.asarray(lam, float))


def whiten(x, mask):
    """(x - mean) / sqrt(var + 1e-8) with the unbiased variance over all valid entries."""
    x = np.asarray(x, dtype=np.float64)
    sel = x[np.asarray(mask) != 0]
    return (x - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8)

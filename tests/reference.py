"""Independent reference implementations of docs/definitions.md §5, written as the direct sums.

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


# Row functions: r and v hold one row's valid tokens in order (the compacted sequence).


def mc_row(r, gamma):
    """G_t = Σ_{k=t}^{L-1} γ^{k-t} r_k"""
    L = len(r)
    return np.array([sum(gamma ** (k - t) * r[k] for k in range(t, L)) for t in range(L)])


def nstep_row(r, v, gamma, n):
    """Σ_{k=t}^{min(t+n,L)-1} γ^{k-t} r_k + γ^n V_{t+n} (only if t+n < L)"""
    L = len(r)
    out = []
    for t in range(L):
        g = sum(gamma ** (k - t) * r[k] for k in range(t, min(t + n, L)))
        if t + n < L:
            g += gamma**n * v[t + n]
        out.append(g)
    return np.array(out)


def td0_row(r, v, gamma):
    """r_t + γ V_{t+1}, V_L = 0"""
    L = len(r)
    return np.array([r[t] + (gamma * v[t + 1] if t + 1 < L else 0.0) for t in range(L)])


def deltas_row(r, v, gamma):
    """δ_t = r_t + γ V_{t+1} − V_t, V_L = 0"""
    L = len(r)
    return np.array([r[t] + (gamma * v[t + 1] if t + 1 < L else 0.0) - v[t] for t in range(L)])


def gae_row(r, v, gamma, lam):
    """A_t = Σ_l (γλ)^l δ_{t+l}"""
    d = deltas_row(r, v, gamma)
    L = len(r)
    return np.array([sum((gamma * lam) ** (k - t) * d[k] for k in range(t, L)) for t in range(L)])


def mc_returns(rewards, mask, gamma):
    return _per_row(lambda r, _v, g: mc_row(r, g), rewards, None, mask, gamma)


def td0_returns(rewards, values, mask, gamma):
    return _per_row(td0_row, rewards, values, mask, gamma)


def nstep_returns(rewards, values, mask, gamma, n):
    return _per_row(nstep_row, rewards, values, mask, gamma, n)


def deltas(rewards, values, mask, gamma):
    return _per_row(deltas_row, rewards, values, mask, gamma)


def gae_advantages(rewards, values, mask, gamma, lam):
    """lam: a float or an array with one λ per row."""
    return _per_row(gae_row, rewards, values, mask, gamma, lam if np.isscalar(lam) else np.asarray(lam, float))


def whiten(x, mask):
    """(x - mean) / sqrt(var + 1e-8) with the unbiased variance over all valid entries."""
    x = np.asarray(x, dtype=np.float64)
    sel = x[np.asarray(mask) != 0]
    return (x - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8)

"""Independent reference implementations of docs/definitions.md §5 (and §7's turns), written as the direct sums.

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


# v_last: V_L, the value after the last valid token (0 unless a cut response bootstraps from the critic).


def mc_row(r, gamma, v_last=0.0):
    """G_t = Σ_{k=t}^{L-1} γ^{k-t} r_k + γ^{L-t} V_L"""
    L = len(r)
    return np.array([sum(gamma ** (k - t) * r[k] for k in range(t, L)) + gamma ** (L - t) * v_last for t in range(L)])


def nstep_row(r, v, gamma, n, v_last=0.0):
    """Σ_{k=t}^{min(t+n,L)-1} γ^{k-t} r_k + γ^n V_{t+n} if t+n < L, else + γ^{L-t} V_L"""
    L = len(r)
    out = []
    for t in range(L):
        g = sum(gamma ** (k - t) * r[k] for k in range(t, min(t + n, L)))
        if t + n < L:
            g += gamma**n * v[t + n]
        else:
            g += gamma ** (L - t) * v_last
        out.append(g)
    return np.array(out)


def td0_row(r, v, gamma, v_last=0.0):
    """r_t + γ V_{t+1}, V_L as given"""
    L = len(r)
    return np.array([r[t] + gamma * (v[t + 1] if t + 1 < L else v_last) for t in range(L)])


def deltas_row(r, v, gamma, v_last=0.0):
    """δ_t = r_t + γ V_{t+1} − V_t, V_L as given"""
    L = len(r)
    return np.array([r[t] + gamma * (v[t + 1] if t + 1 < L else v_last) - v[t] for t in range(L)])


def gae_row(r, v, gamma, lam, v_last=0.0):
    """A_t = Σ_l (γλ)^l δ_{t+l}"""
    d = deltas_row(r, v, gamma, v_last)
    L = len(r)
    return np.array([sum((gamma * lam) ** (k - t) * d[k] for k in range(t, L)) for t in range(L)])


def mc_returns(rewards, mask, gamma):
    return _per_row(lambda r, _v, g: mc_row(r, g), rewards, None, mask, gamma)


def td0_returns(rewards, values, mask, gamma):
    return _per_row(td0_row, rewards, values, mask, gamma)


def nstep_returns(rewards, values, mask, gamma, n, v_last=None):
    """v_last: one V_L per row (None: 0)."""
    return _per_row(nstep_row, rewards, values, mask, gamma, n, np.zeros(len(rewards)) if v_last is None else np.asarray(v_last, float))


def cut_rows(responses, mask, eos_ids, max_response_length) -> np.ndarray:
    """(B,) bool: the row's last valid token sits at max_response_length − 1 and is not an EOS id."""
    responses, mask = np.asarray(responses), np.asarray(mask)
    cut = np.zeros(len(mask), bool)
    for b in range(len(mask)):
        idx = valid_positions(mask[b])
        cut[b] = len(idx) > 0 and idx[-1] + 1 == max_response_length and int(responses[b, idx[-1]]) not in eos_ids
    return cut


def deltas(rewards, values, mask, gamma):
    return _per_row(deltas_row, rewards, values, mask, gamma)


def gae_advantages(rewards, values, mask, gamma, lam, v_last=None):
    """lam: a float or an array with one λ per row; v_last: one V_L per row (None: 0)."""
    lam = lam if np.isscalar(lam) else np.asarray(lam, float)
    return _per_row(gae_row, rewards, values, mask, gamma, lam, np.zeros(len(rewards)) if v_last is None else np.asarray(v_last, float))


def turns_of_row(mask_row) -> list[list[int]]:
    """The positions of each assistant turn: maximal runs of valid tokens, in order."""
    turns, current = [], []
    for t, m in enumerate(np.asarray(mask_row)):
        if m != 0:
            current.append(t)
        elif current:
            turns.append(current)
            current = []
    if current:
        turns.append(current)
    return turns


def turn_gae_row(r_row, v_row, mask_row, gamma, lam, v_last=0.0):
    """Turn-level GAE on one padded row (holes and padding included), nan at masked positions:
    R_k = Σ r over turn k, V_k = V at its first token, V_K = V_L (0 unless given), δ_k = R_k + γ V_{k+1} − V_k,
    A_k = Σ_{j≥k} (γλ)^{j−k} δ_j on every token of turn k."""
    turns = turns_of_row(mask_row)
    K = len(turns)
    R = [sum(float(r_row[t]) for t in turn) for turn in turns]
    V = [float(v_row[turn[0]]) for turn in turns] + [float(v_last)]
    delta = [R[k] + gamma * V[k + 1] - V[k] for k in range(K)]
    A = [sum((gamma * lam) ** (j - k) * delta[j] for j in range(k, K)) for k in range(K)]
    out = np.full(len(mask_row), np.nan)
    for k, turn in enumerate(turns):
        out[turn] = A[k]
    return out


def turn_gae_advantages(rewards, values, mask, gamma, lam):
    """(B, T) turn-level GAE advantages; lam a float or one λ per row."""
    rewards, values, mask = (np.asarray(x, dtype=np.float64) for x in (rewards, values, mask))
    lams = np.broadcast_to(np.asarray(lam, dtype=np.float64), (rewards.shape[0],))
    return np.stack([turn_gae_row(rewards[b], values[b], mask[b], gamma, lams[b]) for b in range(rewards.shape[0])])


def whiten(x, mask):
    """(x − μ) / sqrt(σ² + 1e-8) over all valid entries, as docs/definitions.md §6 writes verl's
    masked_whiten with verl's integer response mask: μ = Σx/n, σ² = Σ(x − μ)²/(n − 1)."""
    x = np.asarray(x, dtype=np.float64)
    sel = x[np.asarray(mask) != 0]
    return (x - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8)


def live_metrics(rewards, values, advantage_raw, advantages, scores, mask, uid, gamma) -> dict:
    """docs/definitions.md §9 (live metrics), term by term from (B, T) arrays: the critic's explained variance
    1 − Var(G − V)/Var(G) (n − 1) against G = mc_row over all valid tokens, at each response's last
    one and per decile ⌊10·i/L⌋; std (n − 1) of the raw advantage, mean and std of the advantage;
    the mean over uid groups of ≥ 2 responses of the std of their summed scores; the mean over
    responses of max|A|/Σ|A| and the share of Σ|A| on ranks 2i < L (raw advantage). When a response
    has a hole (§7): the explained variance at the first token of each assistant turn k (turn{k})
    and of all turns k ≥ 1 (after_hole), and the share of Σ|A| on each turn. ``values`` None: no
    critic entries. Undefined entries are left out, as verl-ext leaves them out."""
    import statistics

    def ev(pairs):
        g = [p[0] for p in pairs]
        if len(g) < 8 or statistics.variance(g) == 0:  # docs/definitions.md §9: a bucket needs 8 tokens
            return None
        return 1 - statistics.variance([gi - vi for gi, vi in pairs]) / statistics.variance(g)

    out = {}
    rows = [(b, valid_positions(mask[b])) for b in range(len(mask))]
    rows = [(b, idx) for b, idx in rows if len(idx)]
    turn_of = {b: [sum(1 for j in range(1, i + 1) if idx[j] != idx[j - 1] + 1) for i in range(len(idx))] for b, idx in rows}
    multi_turn = any(max(turns) > 0 for turns in turn_of.values())
    if values is not None:
        buckets = {key: [] for key in ["all", "last", *(f"d{k}" for k in range(10))]}
        for b, idx in rows:
            g = mc_row([float(rewards[b, t]) for t in idx], gamma)
            v = [float(values[b, t]) for t in idx]
            for i in range(len(idx)):
                buckets["all"].append((g[i], v[i]))
                buckets[f"d{10 * i // len(idx)}"].append((g[i], v[i]))
            buckets["last"].append((g[-1], v[-1]))
        out["critic/ev_mc"], out["critic/ev_mc_last"] = ev(buckets["all"]), ev(buckets["last"])
        out |= {f"critic/ev_mc/d{k}": ev(buckets[f"d{k}"]) for k in range(10)}
        if multi_turn:
            firsts = {}
            for b, idx in rows:
                g = mc_row([float(rewards[b, t]) for t in idx], gamma)
                for i, turn in enumerate(turn_of[b]):
                    if i == 0 or turn != turn_of[b][i - 1]:
                        firsts.setdefault(f"turn{turn}", []).append((g[i], float(values[b, idx[i]])))
                        if turn:
                            firsts.setdefault("after_hole", []).append((g[i], float(values[b, idx[i]])))
            out |= {f"critic/ev_mc/{bucket}": ev(pairs) for bucket, pairs in firsts.items()}
    raw = [float(advantage_raw[b, t]) for b, idx in rows for t in idx]
    adv = [float(advantages[b, t]) for b, idx in rows for t in idx]
    out["adv/raw_std"] = statistics.stdev(raw)
    out["adv/whiten_mean"], out["adv/whiten_std"] = statistics.fmean(adv), statistics.stdev(adv)
    groups = {}
    for b, idx in rows:
        groups.setdefault(str(uid[b]), []).append(sum(float(scores[b, t]) for t in idx))
    stds = [statistics.stdev(s) for s in groups.values() if len(s) >= 2]
    out["reward/group_std"] = statistics.fmean(stds) if stds else None
    top, first_half, total = [], 0.0, 0.0
    for b, idx in rows:
        a = [abs(float(advantage_raw[b, t])) for t in idx]
        if sum(a) > 0:
            top.append(max(a) / sum(a))
        first_half += sum(x for i, x in enumerate(a) if 2 * i < len(a))
        total += sum(a)
    out["credit/top_token_share"] = statistics.fmean(top) if top else None
    out["credit/first_half_share"] = first_half / total if total > 0 else None
    if multi_turn and total > 0:
        for b, idx in rows:
            for i, t in enumerate(idx):
                key = f"credit/share/turn{turn_of[b][i]}"
                out[key] = out.get(key, 0.0) + abs(float(advantage_raw[b, t])) / total
    return {key: value for key, value in out.items() if value is not None}


def offpolicy_gap(old, rollout, mask) -> dict:
    """docs/definitions.md#off-policy-tokens, from (B, T) arrays over the valid tokens: the median, the
    99th percentile (linear between order statistics) and the largest |ℓ_t|, ℓ_t = log π_old − log π_rollout,
    and KL(π_rollout ‖ π_old) estimated as mean(−ℓ_t)."""
    import statistics

    ell = [float(old[b, t]) - float(rollout[b, t]) for b in range(len(mask)) for t in valid_positions(mask[b])]
    gap = [abs(x) for x in ell]
    return {
        "offpolicy/lp_gap_p50": statistics.median(gap),
        "offpolicy/lp_gap_p99": statistics.quantiles(gap, n=100, method="inclusive")[98],
        "offpolicy/lp_gap_max": max(gap),
        "offpolicy/kl": statistics.fmean(-x for x in ell),
    }

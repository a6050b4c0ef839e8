"""The update tables against docs/definitions.md §8: what PPO did with each token, checked per step.

Identities (on every row of a step's update tables, each with its tolerance):

* ``update_rows``: every valid token of the token table is trained exactly once per epoch, and the
  rows carry the token table's old_log_prob and advantage (actor), value and return (critic): the
  join by (step, sample, token_index) is right whatever verl's shuffling and batching did;
* ``ratio``: ratio = exp(clamp(log_prob − old_log_prob, −20, 20));
* ``ratio_first``: in the first mini-batch of the first epoch the actor has not stepped yet, so
  ratio = 1 up to the noise of recomputing log-probs (reported);
* ``pg_loss``: the per-token term equals vanilla PPO's with dual clip, times the rollout weight
  (other loss modes: skipped, their formula is not checked here);
* ``clip``: the clip code follows from the ratio, the advantage and the configured ε (exact);
* ``vf_loss``: vpred_clipped, the loss term and vf_clipped equal verl's clipped value loss;
* ``update_metrics``: the terms, aggregated as verl does with the run's loss_agg_mode (per
  mini-batch over its global tokens, micro-batch means for the fractions, then the mean over
  mini-batches and epochs), reproduce verl's logged actor/pg_loss, actor/pg_clipfrac,
  actor/pg_clipfrac_lower, critic/vf_loss and critic/vf_clipfrac.

Also :func:`update_statistics` (clip fractions and the correlation of advantage and Δlog-prob per
step, for the summary).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from verl_ext.inspect.stepdata import StepData

#: The identities of the update, in report order.
UPDATE_IDENTITIES = ("update_rows", "ratio", "ratio_first", "pg_loss", "clip", "vf_loss", "update_metrics")
#: How far the first mini-batch's ratio may be from 1: the recomputation noise of the log-probs
#: (fp32 on CPU: below 1e-5; bf16 engines on GPU: up to a few 1e-3).
RATIO_NOISE = 1e-2
EPS32 = float(np.finfo(np.float32).eps)
ATOL = 1e-6
TOLERANCE_TEXT = {
    "update_rows": "exact",
    "ratio": f"{ATOL:g} + 4ε·ratio·(1 + |Δlog-prob|)",
    "ratio_first": f"|ratio − 1| ≤ {RATIO_NOISE:g}",
    "pg_loss": f"{ATOL:g} + 8ε·|A|·max(ratio, c)",
    "clip": "exact (float32, verl's comparisons)",
    "vf_loss": f"{ATOL:g} + 8ε·(|vpred| + |value| + |return| + ε_v)²",
    "update_metrics": f"{ATOL:g} + ε·n·max|term| (n: tokens of the largest mini-batch)",
}
TITLES = {
    "update_rows": "each valid token trained once per epoch; rows join the token table",
    "ratio": "ratio = exp(log_prob − old_log_prob)",
    "ratio_first": "ratio = 1 in epoch 0, mini-batch 0",
    "pg_loss": "pg_loss = vanilla PPO term with dual clip",
    "clip": "clip code agrees with ratio and advantage",
    "vf_loss": "vf_loss = max((v̂−R)², (clip(v̂)−R)²)",
    "update_metrics": "aggregated terms = verl's logged update metrics",
}

#: (recorded metric, its check): what each logged metric is reproduced from.
_ACTOR_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower")
_CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clipfrac")


class Outcome:
    """What one identity found on one step; turned into a StepResult by the caller."""

    def __init__(self, identity: str, status: str, checked: int = 0, violations: int = 0,
                 max_abs_error: float | None = None, first: dict[str, Any] | None = None, note: str | None = None):  # fmt: skip
        self.identity, self.status, self.checked, self.violations = identity, status, checked, violations
        self.max_abs_error, self.first, self.note = max_abs_error, first, note


def check_update(trace, step: int, tokens: StepData) -> Iterator[Outcome]:
    """The update identities of one step; ``tokens`` has the token table's valid tokens of the step."""
    settings = trace.record.update or {}
    actor = _table(trace, "actor", step)
    critic = _table(trace, "critic", step)
    if actor is None and critic is None:
        why = "no update tables (verl_ext.trace.update=false, a trace of schema version 1, or a step whose update failed)"
        for identity in UPDATE_IDENTITIES:
            yield Outcome(identity, "skipped", note=f"not applicable: {why}")
        return
    keys = _token_keys(tokens)
    yield _rows(tokens, keys, actor, critic)
    yield from _actor_identities(actor, settings.get("actor", {}))
    yield _value_loss(critic, settings.get("critic", {}))
    yield _metrics(trace, step, actor, critic, settings)


# --------------------------------------------------------------------------- reading


def _table(trace, kind: str, step: int) -> dict[str, np.ndarray] | None:
    if step not in trace.update_steps.get(kind, []):
        return None
    table = trace.actor_update(step) if kind == "actor" else trace.critic_update(step)
    return {name: _numpy(table.column(name)) for name in table.column_names}


def _numpy(column) -> np.ndarray:
    if column.null_count == len(column) and len(column):
        return None
    values = column.to_numpy(zero_copy_only=False)
    return values.astype(np.float64) if values.dtype.kind == "f" else values


def _token_keys(tokens: StepData) -> np.ndarray:
    """Sorted keys (sample, token_index) of the step's valid tokens, as one int64 each."""
    layout = tokens.layout
    sample = layout.sample_ids[layout.row_sample[layout.valid_rows]].astype(np.int64)
    return sample << 32 | layout.token_index[layout.valid_rows].astype(np.int64)


def _lookup(keys: np.ndarray, table: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(index into the token table's valid tokens, found) for each update row."""
    wanted = table["sample"].astype(np.int64) << 32 | table["token_index"].astype(np.int64)
    index = np.minimum(np.searchsorted(keys, wanted), max(len(keys) - 1, 0))
    found = keys[index] == wanted if len(keys) else np.zeros(len(wanted), bool)
    return index, found


def _first(table, i: int, column: str, actual=None, expected=None, error=None, tolerance=None, detail=None) -> dict:
    """The first offending row, for the report: where, which column, what was due."""
    where = f"{column} (epoch {int(table['epoch'][i])}, mini-batch {int(table['minibatch'][i])})"
    return {
        "sample": int(table["sample"][i]), "token_index": int(table["token_index"][i]), "column": where,
        "actual": _float(actual), "expected": _float(expected), "error": _float(error), "tolerance": _float(tolerance),
        "detail": detail,
    }  # fmt: skip


def _float(value) -> float | None:
    return None if value is None else float(value)


def _compare(identity: str, table, column: str, actual, expected, tolerance, note=None) -> Outcome:
    error = np.abs(actual - expected)
    bad = ~(error <= tolerance)  # nan is a violation
    first = None
    if bad.any():
        i = int(np.argmax(bad))
        first = _first(table, i, column, actual[i], expected[i], error[i], np.broadcast_to(tolerance, error.shape)[i])
    return Outcome(
        identity, "fail" if bad.any() else "pass", checked=len(error), violations=int(bad.sum()),
        max_abs_error=float(np.nanmax(error)) if len(error) else None, first=first, note=note,
    )  # fmt: skip


# --------------------------------------------------------------------------- the identities


def _rows(tokens: StepData, keys: np.ndarray, actor, critic) -> Outcome:
    """Coverage (each valid token once per epoch, nothing else) and the join's values."""
    checked, problems, first = 0, 0, None
    joined = {"actor": ("old_log_prob", "advantage"), "critic": ("value", "return")}
    for kind, table in (("actor", actor), ("critic", critic)):
        if table is None:
            continue
        index, found = _lookup(keys, table)
        for epoch in np.unique(table["epoch"]):
            in_epoch = table["epoch"] == epoch
            counts = np.bincount(index[in_epoch & found], minlength=len(keys))
            missing, repeated, stray = int((counts == 0).sum()), int((counts > 1).sum()), int((in_epoch & ~found).sum())
            checked += len(keys)
            if missing or repeated or stray:
                problems += missing + repeated + stray
                if first is None:
                    where = np.flatnonzero(in_epoch & ~found)
                    i = int(where[0]) if len(where) else int(np.flatnonzero(in_epoch)[0])
                    first = _first(table, i, kind, detail=f"epoch {epoch}: {missing} valid token(s) not trained, "
                                   f"{repeated} trained more than once, {stray} row(s) not in the token table")  # fmt: skip
        for column in joined[kind]:
            expected = tokens.columns.get(column)
            if expected is None or table.get(column) is None:
                continue
            mismatch = found & ~np.isclose(table[column], expected[index], rtol=0, atol=ATOL + 4 * EPS32 * np.abs(expected[index]))
            checked += int(found.sum())
            if mismatch.any():
                problems += int(mismatch.sum())
                i = int(np.argmax(mismatch))
                first = first or _first(table, i, f"{kind} {column}", detail=f"{table[column][i]:.7g} differs from the token table's {expected[index[i]]:.7g}")
    return Outcome("update_rows", "fail" if problems else "pass", checked=checked, violations=problems, first=first)


def _actor_identities(actor, settings: dict) -> Iterator[Outcome]:
    if actor is None:
        for identity in ("ratio", "ratio_first", "pg_loss", "clip"):
            yield Outcome(identity, "skipped", note="not applicable: no actor update table (critic warm-up?)")
        return
    lp, olp, ratio, advantage = actor["log_prob"], actor["old_log_prob"], actor["ratio"], actor["advantage"]
    delta = np.clip(lp - olp, -20.0, 20.0)
    yield _compare("ratio", actor, "ratio", ratio, np.exp(delta), ATOL + 4 * EPS32 * np.abs(ratio) * (1 + np.abs(delta)))

    first_minibatch = (actor["epoch"] == 0) & (actor["minibatch"] == 0)
    noise = float(np.max(np.abs(ratio[first_minibatch] - 1))) if first_minibatch.any() else None
    outcome = _compare("ratio_first", {k: v[first_minibatch] for k, v in actor.items() if v is not None},
                       "ratio", ratio[first_minibatch], np.ones(int(first_minibatch.sum())), RATIO_NOISE)  # fmt: skip
    outcome.note = None if noise is None else f"recomputation noise max |ratio − 1| = {noise:.1e}"
    yield outcome

    low, high, c = settings.get("clip_ratio_low", 0.2), settings.get("clip_ratio_high", 0.2), settings.get("clip_ratio_c", 3.0)
    mode = settings.get("loss_mode", "vanilla")
    if mode != "vanilla":
        yield Outcome("pg_loss", "skipped", note=f"loss mode {mode!r}: only vanilla PPO's formula is checked")
    else:
        exact = np.exp(delta)
        l1 = np.maximum(-advantage * exact, -advantage * np.clip(exact, 1 - low, 1 + high))
        term = np.where(advantage < 0, np.minimum(l1, -advantage * c), l1)
        if actor.get("is_weight") is not None:
            term = term * actor["is_weight"]
        tolerance = ATOL + 8 * EPS32 * np.abs(advantage) * np.maximum(exact, c)
        yield _compare("pg_loss", actor, "pg_loss", actor["pg_loss"], term, tolerance)

    expected = _clip_codes(ratio.astype(np.float32), advantage.astype(np.float32), low, high, c)
    wrong = actor["clip"] != expected
    first = None
    if wrong.any():
        i = int(np.argmax(wrong))
        first = _first(actor, i, "clip", detail=f"{actor['clip'][i]!r} where ratio {ratio[i]:.6g} and advantage {advantage[i]:.6g} give {expected[i]!r}")
    yield Outcome("clip", "fail" if wrong.any() else "pass", checked=len(wrong), violations=int(wrong.sum()), first=first)


def _clip_codes(ratio: np.ndarray, advantage: np.ndarray, low: float, high: float, c: float) -> np.ndarray:
    """verl's comparisons (compute_policy_loss_vanilla) in float32: none, low, high or dual per token."""
    f32 = np.float32
    pg1 = -advantage * ratio
    pg2 = -advantage * np.clip(ratio, f32(1 - low), f32(1 + high))
    clipped = pg2 > pg1
    dual = (np.maximum(pg1, pg2) > -advantage * f32(c)) & (advantage < 0)
    return np.where(dual, "dual", np.where(clipped, np.where(advantage < 0, "low", "high"), "none")).astype(object)


def _value_loss(critic, settings: dict) -> Outcome:
    if critic is None:
        return Outcome("vf_loss", "skipped", note="not applicable: no critic update table (critic-free estimator)")
    epsilon = settings.get("cliprange_value", 0.5)
    vpred, value, ret = critic["vpred"], critic["value"], critic["return"]
    clipped = np.clip(vpred, value - epsilon, value + epsilon)
    scale = ATOL + 8 * EPS32 * (np.abs(vpred) + np.abs(value) + np.abs(ret) + epsilon) ** 2
    outcomes = [
        _compare("vf_loss", critic, "vpred_clipped", critic["vpred_clipped"], clipped, ATOL + 4 * EPS32 * (np.abs(value) + epsilon)),
        _compare("vf_loss", critic, "vf_loss", critic["vf_loss"], np.maximum((vpred - ret) ** 2, (clipped - ret) ** 2), scale),
    ]
    f32 = np.float32
    vp, cl, r = vpred.astype(f32), critic["vpred_clipped"].astype(f32), ret.astype(f32)
    flag = (cl - r) ** 2 > (vp - r) ** 2
    wrong = critic["vf_clipped"] != flag
    first = _first(critic, int(np.argmax(wrong)), "vf_clipped", detail="disagrees with the clipped and unclipped squares") if wrong.any() else None
    outcomes.append(Outcome("vf_loss", "fail" if wrong.any() else "pass", checked=len(wrong), violations=int(wrong.sum()), first=first))
    failed = [o for o in outcomes if o.status == "fail"]
    errors = [o.max_abs_error for o in outcomes if o.max_abs_error is not None]
    return Outcome(
        "vf_loss", "fail" if failed else "pass", checked=sum(o.checked for o in outcomes),
        violations=sum(o.violations for o in outcomes), max_abs_error=max(errors) if errors else None,
        first=failed[0].first if failed else None,
    )  # fmt: skip


def _metrics(trace, step: int, actor, critic, settings: dict) -> Outcome:
    """verl's logged update metrics from the per-token terms (docs/definitions.md §8)."""
    checks: list[tuple[str, float, float, float]] = []  # (metric, logged, reproduced, tolerance)
    for kind, table, names in (("actor", actor, _ACTOR_METRICS), ("critic", critic, _CRITIC_METRICS)):
        if table is None:
            continue
        record = trace.update_record(kind, step)
        mode = settings.get(kind, {}).get("loss_agg_mode", "token-mean")
        scale = settings.get(kind, {}).get("loss_scale_factor")
        term = table["pg_loss"] if kind == "actor" else table["vf_loss"]
        reproduced = {
            names[0]: (0.5 if kind == "critic" else 1.0) * _aggregate(table, term, record.minibatches, mode, scale),
            names[1]: _fraction(table, (table["clip"] == "low") | (table["clip"] == "high") if kind == "actor" else table["vf_clipped"], kind),
        }
        if kind == "actor":
            reproduced[names[2]] = _fraction(table, table["clip"] == "dual", kind)
        largest = max((m.get("batch_num_tokens") or 0 for m in record.minibatches), default=0)
        loss_tolerance = ATOL + EPS32 * max(largest, 1) * float(np.nanmax(np.abs(term))) if len(term) else ATOL
        for name, value in reproduced.items():
            if name in record.logged:
                checks.append((name, record.logged[name], value, loss_tolerance if name == names[0] else ATOL))
    if not checks:
        return Outcome("update_metrics", "skipped", note="no logged update metrics recorded")
    errors = [abs(logged - value) for _, logged, value, _ in checks]
    bad = [i for i, (_, _, _, tol) in enumerate(checks) if not errors[i] <= tol]
    first = None
    if bad:
        name, logged, value, tol = checks[bad[0]]
        first = {"column": name, "actual": logged, "expected": value, "error": errors[bad[0]], "tolerance": tol}
    return Outcome("update_metrics", "fail" if bad else "pass", checked=len(checks), violations=len(bad),
                   max_abs_error=max(errors), first=first)  # fmt: skip


def _aggregate(table, term: np.ndarray, minibatches: list[dict], mode: str, scale) -> float:
    """verl's agg_loss per (epoch, mini-batch) over its global tokens or sequences, then the mean."""
    values = []
    for info in minibatches:
        rows = (table["epoch"] == info["epoch"]) & (table["minibatch"] == info["minibatch"])
        if mode == "token-mean":
            values.append(term[rows].sum() / (info.get("batch_num_tokens") or max(int(rows.sum()), 1)))
            continue
        samples, inverse = np.unique(table["sample"][rows], return_inverse=True)
        per_sequence = np.bincount(inverse, weights=term[rows])
        sequences = info.get("global_batch_size") or len(samples)
        if mode == "token-sum":
            values.append(term[rows].sum())
        elif mode == "seq-mean-token-mean":
            values.append((per_sequence / np.bincount(inverse)).sum() / sequences)
        elif mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
            norm = (scale or 1.0) if mode.endswith("norm") else 1.0
            values.append(per_sequence.sum() / sequences / norm)
        else:
            raise ValueError(f"loss_agg_mode {mode!r} is not reproduced by the checker")
    return float(np.mean(values)) if values else float("nan")


def _fraction(table, flag: np.ndarray, kind: str) -> float:
    """verl's clip fractions: a token mean per micro-batch, then means over ranks, micro-batches and
    mini-batches (actor, ``Metric`` MEAN), or one flat mean of all micro-batch values (critic)."""
    groups, inverse = _unique_rows([table[k] for k in ("epoch", "minibatch", "microbatch", "rank")])
    per_micro = np.bincount(inverse, weights=flag.astype(np.float64)) / np.bincount(inverse)
    if kind == "critic":
        return float(per_micro.mean())
    by = {}
    for (epoch, minibatch, microbatch, _), value in zip(groups, per_micro):
        by.setdefault((epoch, minibatch), {}).setdefault(microbatch, []).append(value)
    return float(np.mean([np.mean([np.mean(ranks) for ranks in micro.values()]) for micro in by.values()]))


def _unique_rows(columns: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(np.stack(columns, 1), axis=0, return_inverse=True)`` for small non-negative
    integer columns, as one int64 code per row (sorting rows of a stacked array is far slower)."""
    columns = [np.asarray(c, np.int64) for c in columns]
    if not len(columns[0]) or min(int(c.min()) for c in columns) < 0:
        groups, inverse = np.unique(np.stack(columns, axis=1), axis=0, return_inverse=True)
        return groups, inverse.reshape(-1)
    radix = [int(c.max()) + 1 for c in columns]
    code = columns[0]
    for column, base in zip(columns[1:], radix[1:]):
        code = code * base + column
    codes, inverse = np.unique(code, return_inverse=True)
    return np.stack(np.unravel_index(codes, radix), axis=1), inverse.reshape(-1)


# --------------------------------------------------------------------------- statistics


def update_statistics(trace, step: int) -> dict[str, float | None]:
    """Per step: the fractions of actor-update tokens clipped low and high (dual: below), and the
    correlation of the advantage with Δlog-prob = log_prob − old_log_prob in the last epoch."""
    empty = {"clip_low": None, "clip_high": None, "clip_dual": None, "adv_dlogp_corr": None}
    if step not in trace.update_steps.get("actor", []):
        return empty
    table = trace.actor_update(step, columns=["epoch", "clip", "advantage", "log_prob", "old_log_prob"])
    if not table.num_rows:
        return empty
    clip = table.column("clip").to_numpy(zero_copy_only=False)
    epoch = table.column("epoch").to_numpy()
    last = epoch == epoch.max()

    def floats(name: str) -> np.ndarray:
        return np.asarray(table.column(name).fill_null(float("nan")).to_numpy(zero_copy_only=False), float)

    advantage = floats("advantage")[last]
    change = (floats("log_prob") - floats("old_log_prob"))[last]
    corr = float(np.corrcoef(advantage, change)[0, 1]) if len(change) > 1 and change.std() > 0 and advantage.std() > 0 else None
    return {
        "clip_low": float((clip == "low").mean()),
        "clip_high": float((clip == "high").mean()),
        "clip_dual": float((clip == "dual").mean()),
        "adv_dlogp_corr": corr,
    }

"""The update tables against docs/definitions.md §8.6: what PPO did with each token, checked per step.

The identities (their records: :data:`verl_ext.check.identities.IDENTITIES`), on every row of a
step's update tables:

* ``update_rows``: every valid token of the token table is trained exactly once per epoch (at most
  once in a replay's trace, which holds some of the mini-batches: its run record's ``replay``), and the
  rows carry the token table's old_log_prob and advantage (actor), value and return (critic): the
  join by (step, sample, token_index) is right whatever verl's shuffling and batching did;
* ``ratio``: the recorded ratio is the one verl's loss used. Against the log-probs verl's loss was
  given (the row's log_prob and old_log_prob): ratio = exp(clamp(log_prob − old_log_prob, −20, 20));
  and against what verl returned: with vanilla PPO, verl's own per-token loss matrix (the pg_loss
  column, taken from verl's ``agg_loss`` call) equals −A·ratio·w on every token outside the clip
  regions (A > 0 and ratio ≤ 1+ε_high, or A ≤ 0 and 1−ε_low ≤ ratio ≤ c). What verl logged of the
  ratio, ``actor/ppo_kl``, is reproduced from the recorded ratios in ``update_metrics``;
* ``ratio_first``: in the first mini-batch of the first epoch the actor has not stepped yet, so
  ratio = 1 up to the noise of recomputing log-probs (reported);
* ``pg_loss``: verl's per-token loss term equals vanilla PPO's with dual clip recomputed from the
  log-probs, times the rollout weight (other loss modes: skipped, their formula is not checked here);
* ``clip``: the recorded clip code is the clip verl's loss applied: with vanilla PPO, verl's loss
  matrix equals the term the code implies, −A·w times ratio (none), 1−ε_low (low), 1+ε_high (high)
  or c (dual). A code near a boundary, where the terms coincide, cannot be told from its neighbour
  this way; verl's own comparisons count it in ``actor/pg_clipfrac`` and ``actor/pg_clipfrac_lower``,
  which ``update_metrics`` reproduces from the codes exactly;
* ``vf_loss``: vpred_clipped, the loss term and vf_clipped equal verl's clipped value loss;
* ``update_metrics``: the terms, aggregated as verl does with the run's loss_agg_mode (per
  mini-batch over its global tokens, micro-batch means for the fractions and ppo_kl, then the mean
  over mini-batches and epochs), reproduce verl's logged actor/pg_loss, actor/pg_clipfrac,
  actor/pg_clipfrac_lower, actor/ppo_kl (vanilla PPO), critic/vf_loss and critic/vf_clipfrac.

The per-token ratio and clip code are the update hook's (:mod:`verl_ext.integration.update_hook`),
computed with verl's expressions from verl's inputs; so they are checked against what verl computed
from the same inputs (its loss matrix and logged metrics), never against a second copy of those
expressions.

Also :func:`update_statistics` (clip fractions and the correlation of advantage and Δlog-prob per
step, for the summary).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from verl_ext.check.results import (
    ATOL,
    DTYPE_EPS,
    ELEMENTWISE,
    EPS32,
    Finding,
    Location,
    Tolerance,
    Violation,
    combine,
    compare,
    skipped,
)
from verl_ext.steps.layout import StepData, floats, join_keys, locate
from verl_ext.steps.update_rows import UpdateRows
from verl_ext.trace.schema import CLIP_DUAL, CLIP_HIGH, CLIP_LOW, CLIP_NONE

#: How far the first mini-batch's ratio may be from 1: the recomputation noise of the log-probs
#: (fp32 on CPU: below 1e-5; bf16 engines on GPU: up to a few 1e-3), plus a few roundings of the
#: log-probs in the loss's dtype (in bf16 the step between two log-probs near −2 is 1.6e-2).
RATIO_NOISE = 1e-2
#: ε is the machine epsilon of the dtype verl's loss computed in (:meth:`UpdateStep.eps`): the same
#: roundings, in that dtype. One subtraction and exponential.
RATIO = Tolerance(
    f"{ATOL:g} + 4ε·ratio·(1 + |Δlog-prob|); terms: as pg_loss",
    lambda ratio, delta, eps=EPS32: ATOL + 4 * eps * np.abs(ratio) * (1 + np.abs(delta)),
)
RATIO_FIRST = Tolerance(
    f"|ratio − 1| ≤ {RATIO_NOISE:g} + 4ε·(|log_prob| + |old_log_prob|)",
    lambda magnitude=0.0, eps=EPS32: RATIO_NOISE + 4 * eps * magnitude,
)
#: A policy-loss term −A·w·x, x at most max(ratio, c): a few products.
PG_TERM = Tolerance(
    f"{ATOL:g} + 8ε·|A|·max(ratio, c)",
    lambda advantage, ratio, c, eps=EPS32: ATOL + 8 * eps * np.abs(advantage) * np.maximum(ratio, c),
)
VF_TERM = Tolerance(
    f"{ATOL:g} + 8ε·(|vpred| + |value| + |return| + ε_v)²",
    lambda vpred, value, ret, epsilon, eps=EPS32: ATOL + 8 * eps * (np.abs(vpred) + np.abs(value) + np.abs(ret) + epsilon) ** 2,
)
#: A sum of n terms of at most m each (the fractions are exact: ATOL).
AGGREGATE = Tolerance(
    f"{ATOL:g} + ε·n·max|term| (n: tokens of the largest mini-batch)", lambda n, m, eps=EPS32: ATOL + eps * n * m
)

#: (recorded metric, its check): what each logged metric is reproduced from.
_ACTOR_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl")
_CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clipfrac")


class UpdateStep:
    """One step's update tables, as the update identities read them; ``tokens`` has the token
    table's valid tokens of the step."""

    def __init__(self, trace, step: int, tokens: StepData):
        self.trace, self.step, self.tokens = trace, step, tokens
        self.settings = trace.record.update or {}
        self.actor = _table(trace, "actor", step)
        self.critic = _table(trace, "critic", step)
        # the run record holds verl's resolved settings wherever there are update tables: nothing defaulted here
        actor = self.settings.get("actor", {})
        self.low, self.high, self.c, self.loss_mode = (actor.get(key) for key in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_mode"))

    @property
    def bypass_mode(self) -> bool:
        """The run's rollout correction ran in bypass mode (π_old = π_rollout)."""
        correction = (self.trace.record.algorithm or {}).get("rollout_correction") or {}
        return bool(correction.get("bypass_mode"))

    def current_responses(self) -> np.ndarray | None:
        """The samples whose every token the weights the update starts from generated (trainer_version =
        policy_version_min = policy_version_max, substep 0); None where the trace does not say (no policy versions,
        a trace before format 11)."""
        entry = self.trace.step_record(self.step)
        version = getattr(entry, "trainer_version", None)
        prompts = self.trace.prompts(self.step)
        if version is None or "policy_version_min" not in prompts.column_names:
            return None
        low = prompts.column("policy_version_min").to_numpy(zero_copy_only=False)
        high = prompts.column("policy_version_max").to_numpy(zero_copy_only=False)
        if np.isnan(np.asarray(low, np.float64)).all():
            return None
        sample = np.asarray(prompts.column("sample").to_numpy(), np.int64)
        return sample[(low == version) & (high == version)]

    def eps(self, kind: str) -> float:
        """The unit of ``kind``'s tolerances: ε of the dtype its loss computed in, the run record's
        ``update.<kind>.dtype`` (verl_ext.integration.run_record.loss_dtype); float32's where there is
        none (an engine verl-ext does not know, a trace before the field), as every fp32 run is checked."""
        return DTYPE_EPS.get(self.settings.get(kind, {}).get("dtype"), EPS32)

    def unavailable(self, kind: str | None = None) -> Finding | None:
        """Skipped when the step has no update tables, or none of ``kind``."""
        if self.actor is None and self.critic is None:
            return skipped("no update tables (verl_ext.trace.update=false, a trace of schema version 1, or a step whose update failed)")
        if kind == "actor" and self.actor is None:
            return skipped("no actor update table (critic warm-up?)")
        if kind == "critic" and self.critic is None:
            if self.trace.record.replay:
                return skipped("no critic update table (a replay's trace holds the actor's update)")
            return skipped("no critic update table (critic-free estimator)")
        return None

    def where(self, table, column: str | Callable[[int], str], rows=None) -> Callable[[int], tuple[Location, str]]:
        """Names the i-th compared number (row ``rows[i]`` of ``table``): its token and where it was trained."""

        def named(i: int) -> tuple[Location, str]:
            row = int(i if rows is None else rows[i])
            label = column if isinstance(column, str) else column(row)
            at = f"{label} (epoch {int(table['epoch'][row])}, mini-batch {int(table['minibatch'][row])})"
            return Location(self.step, int(table["sample"][row]), int(table["token_index"][row])), at

        return named

    def log_ratio(self) -> np.ndarray:
        """log_prob − old_log_prob clamped to ±20, as verl clamps it before exp (core_algos.py)."""
        return np.clip(self.actor["log_prob"] - self.actor["old_log_prob"], -20.0, 20.0)

    def weighted_advantage(self) -> np.ndarray:
        """A·w: the advantage times the rollout weight verl multiplies into the loss term (1 without)."""
        weight = self.actor.get("is_weight")
        return self.actor["advantage"] * (1.0 if weight is None else weight)


# --------------------------------------------------------------------------- reading


def _table(trace, kind: str, step: int) -> dict[str, np.ndarray] | None:
    if step not in trace.update_steps.get(kind, []):
        return None
    return UpdateRows.read(trace, kind, step).arrays()


def _token_keys(tokens: StepData) -> np.ndarray:
    """Keys (sample, token_index) of the step's valid tokens (:func:`join_keys`)."""
    layout = tokens.layout
    return join_keys(layout.sample_ids[layout.row_sample[layout.valid_rows]], layout.token_index[layout.valid_rows])


def _lookup(keys: np.ndarray, table: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(index into the token table's valid tokens, found) for each update row."""
    return locate(keys, join_keys(table["sample"], table["token_index"]))


# --------------------------------------------------------------------------- the identities


def update_rows(u: UpdateStep) -> Finding:
    """Coverage (each valid token once per epoch, nothing else) and the join's values."""
    if (unavailable := u.unavailable()) is not None:
        return unavailable
    keys = _token_keys(u.tokens)
    # a model-free replay (verl_ext.apps.replay) holds some mini-batches of an epoch: a token they lack is not missing
    partial = bool((u.trace.record.replay or {}).get("minibatches"))
    checked, problems, first = 0, 0, None
    # update column -> the token table's: the weight the loss used is the one verl computed at the advantage step
    joined = {"actor": {"old_log_prob": "old_log_prob", "advantage": "advantage", "is_weight": "rollout_is_weight"},
              "critic": {"value": "value", "return": "return"}}  # fmt: skip
    entry = u.trace.record.steps.get(str(u.step))
    for kind, table in (("actor", u.actor), ("critic", u.critic)):
        if table is None:
            continue
        listed, rows = getattr((entry.updates if entry else {}).get(kind), "rows", None), len(table["epoch"])
        checked += 1
        if isinstance(listed, int) and listed != rows:
            problems += 1
            first = Violation(Location(u.step), f"{kind} rows", float(rows), float(listed), detail="the run record's rows of the update table")
        index, found = _lookup(keys, table)
        for epoch in np.unique(table["epoch"]):
            in_epoch = table["epoch"] == epoch
            counts = np.bincount(index[in_epoch & found], minlength=len(keys))
            missing = 0 if partial else int((counts == 0).sum())
            repeated, stray = int((counts > 1).sum()), int((in_epoch & ~found).sum())
            checked += len(keys)
            if missing or repeated or stray:
                problems += missing + repeated + stray
                if first is None:
                    where = np.flatnonzero(in_epoch & ~found)
                    location, column = u.where(table, kind)(int(where[0]) if len(where) else int(np.flatnonzero(in_epoch)[0]))
                    first = Violation(location, column, detail=f"epoch {epoch}: {missing} valid token(s) not trained, "
                                      f"{repeated} trained more than once, {stray} row(s) not in the token table")  # fmt: skip
        for column, token_column in joined[kind].items():
            expected = u.tokens.columns.get(token_column)
            if expected is None or table.get(column) is None:
                continue
            mismatch = found & ~(np.abs(table[column] - expected[index]) <= ELEMENTWISE(np.abs(expected[index])))
            checked += int(found.sum())
            if mismatch.any():
                problems += int(mismatch.sum())
                i = int(np.argmax(mismatch))
                location, label = u.where(table, f"{kind} {column}")(i)
                detail = f"{table[column][i]:.7g} differs from the token table's {expected[index[i]]:.7g}"
                first = first or Violation(location, label, detail=detail)
    return Finding("fail" if problems else "pass", checked=checked, violations=problems, first=first)


def ratio(u: UpdateStep) -> Finding:
    """The recorded ratio against the log-probs verl's loss was given, and (vanilla PPO) against
    verl's loss matrix on the tokens no clip applies to."""
    if (unavailable := u.unavailable("actor")) is not None:
        return unavailable
    actor = u.actor
    recorded, advantage = actor["ratio"], actor["advantage"]
    delta = u.log_ratio()
    findings = [compare(recorded, np.exp(delta), RATIO(recorded, delta, u.eps("actor")), u.where(actor, "ratio"))]
    if u.loss_mode != "vanilla":
        return combine(findings, note=f"loss mode {u.loss_mode!r}: against the log-probs only (its loss is not vanilla PPO's)")
    # outside every clip region (decided from the ratio, not from the recorded codes: a wrong code is clip's finding)
    unclipped = np.flatnonzero(np.where(advantage > 0, recorded <= 1 + u.high, (recorded >= 1 - u.low) & (recorded <= u.c)))
    scaled = u.weighted_advantage()[unclipped]
    term = -scaled * recorded[unclipped]
    tolerance = PG_TERM(scaled, recorded[unclipped], u.c)
    findings.append(compare(actor["pg_loss"][unclipped], term, tolerance, u.where(actor, "verl's pg_loss against −A·ratio", unclipped)))
    return combine(findings)


def ratio_first(u: UpdateStep) -> Finding:
    """ratio = 1 on the first mini-batch of the first epoch, where π_old's weights are π_θ's at the update's
    start: not on an update that follows others of its sync cycle (``substep`` > 0: π_old is the cycle's first
    weights in verl's decoupled PPO, π_θ has moved since), and in bypass mode (π_old = π_rollout) only on the
    responses generated by the weights the update starts from (staleness 0; all of them where the trace has no
    policy versions). docs/definitions.md#policy-versions."""
    if (unavailable := u.unavailable("actor")) is not None:
        return unavailable
    actor = u.actor
    entry = u.trace.step_record(u.step)
    substep = getattr(entry, "substep", None)
    if substep:
        return skipped(
            f"update {substep + 1} of its sync cycle: π_old is the weights the cycle's first update started from, "
            f"π_θ has taken {substep} update(s) since (docs/definitions.md#policy-versions)"
        )
    first = (actor["epoch"] == 0) & (actor["minibatch"] == 0)
    if u.bypass_mode:
        current = u.current_responses()
        if current is not None:
            first &= np.isin(actor["sample"], current)
            if not first.any():
                return skipped("bypass mode: π_old = π_rollout, and no response of the step was generated by the weights "
                               "the update starts from (docs/definitions.md#policy-versions)")
    first = np.flatnonzero(first)
    noise = float(np.max(np.abs(actor["ratio"][first] - 1))) if len(first) else None
    note = None if noise is None else f"recomputation noise max |ratio − 1| = {noise:.1e}"
    if note is not None and u.eps("actor") != EPS32:  # the footer's ε is float32's
        dtype = u.settings["actor"]["dtype"]
        note += f"; ε of §8.6 = {dtype}'s {u.eps('actor'):.1e}, the dtype of verl's loss (docs/definitions.md#in-a-bf16-run)"
    magnitude = np.abs(actor["log_prob"][first]) + np.abs(actor["old_log_prob"][first])
    tolerance = RATIO_FIRST(magnitude, u.eps("actor"))
    return compare(actor["ratio"][first], np.ones(len(first)), tolerance, u.where(actor, "ratio", first), note)


def pg_loss(u: UpdateStep) -> Finding:
    """verl's loss matrix against vanilla PPO's term with dual clip, recomputed from the log-probs."""
    if (unavailable := u.unavailable("actor")) is not None:
        return unavailable
    if u.loss_mode != "vanilla":
        return Finding("skipped", note=f"loss mode {u.loss_mode!r}: only vanilla PPO's formula is checked")
    actor, low, high, c = u.actor, u.low, u.high, u.c
    advantage = actor["advantage"]
    exact = np.exp(u.log_ratio())
    l1 = np.maximum(-advantage * exact, -advantage * np.clip(exact, 1 - low, 1 + high))
    term = np.where(advantage < 0, np.minimum(l1, -advantage * c), l1)
    if actor.get("is_weight") is not None:
        term = term * actor["is_weight"]
    tolerance = PG_TERM(u.weighted_advantage(), exact, c, u.eps("actor"))  # the ratio verl used is rounded
    return compare(actor["pg_loss"], term, tolerance, u.where(actor, "pg_loss"))


def bypass_loss(u: UpdateStep) -> Finding:
    """Bypass mode (docs/definitions.md#off-policy-tokens): verl's loss matrix is the ``loss_type`` the run
    asked for, recomputed from the update's log-probs (old = rollout): ``reinforce`` −A·w·log π_θ, w the
    weight verl computes inside the loss from log π_θ − log π_rollout (token level, truncated or zeroed;
    1 without ``rollout_is``), ``ppo_clip`` vanilla PPO (identity pg_loss). A term that is vanilla PPO's
    where REINFORCE was asked is named as such: the workers did not run bypass mode's loss."""
    import torch

    from verl_ext.rollout_correction import is_weights
    from verl_ext.steps.recorded import recorded_correction

    if (unavailable := u.unavailable("actor")) is not None:
        return unavailable
    correction = recorded_correction(u.trace.record.algorithm)
    if correction.loss_type != "reinforce":
        return skipped("bypass mode's ppo_clip: vanilla PPO's term, which identity pg_loss checks")
    if correction.rollout_is == "sequence" or correction.batch_normalize or correction.rejection:
        return skipped("bypass mode's REINFORCE with sequence weights, normalisation or rejection: verl computes them per "
                       "micro-batch, which the update table does not group by")  # fmt: skip
    actor = u.actor
    log_prob, advantage = actor["log_prob"], actor["advantage"]
    log_ratio = actor["log_prob"] - actor["old_log_prob"]  # old = rollout in bypass mode
    weight = np.ones(len(log_prob))
    if correction.rollout_is == "token":
        ones = torch.ones(1, len(log_prob), dtype=torch.float64)
        weight = is_weights(torch.from_numpy(log_ratio)[None], ones, correction)[0].numpy()
    term = -advantage * weight * log_prob
    tolerance = ATOL + 8 * u.eps("actor") * np.abs(advantage) * weight * (np.abs(log_prob) + 1)
    finding = compare(actor["pg_loss"], term, tolerance, u.where(actor, "pg_loss (REINFORCE)"))
    if finding.status == "fail":
        exact = np.exp(u.log_ratio())
        l1 = np.maximum(-advantage * exact, -advantage * np.clip(exact, 1 - u.low, 1 + u.high))
        vanilla = np.where(advantage < 0, np.minimum(l1, -advantage * u.c), l1)
        if np.all(np.abs(actor["pg_loss"] - vanilla) <= PG_TERM(advantage, exact, u.c, u.eps("actor"))):
            said = ("every term is vanilla PPO's, not REINFORCE's: verl's workers did not run bypass mode's loss (verl 0.9.1's "
                    "apply_bypass_mode sets loss_mode=bypass_mode in the driver's config, which workers in other processes never see)")  # fmt: skip
            finding = dataclasses.replace(finding, note=said)
    return finding


def clip(u: UpdateStep) -> Finding:
    """The recorded clip code against verl's loss matrix: the term each code implies (vanilla PPO)."""
    if (unavailable := u.unavailable("actor")) is not None:
        return unavailable
    if u.loss_mode != "vanilla":
        return Finding("skipped", note=f"loss mode {u.loss_mode!r}: its loss is not vanilla PPO's, whose clips the codes name")
    actor = u.actor
    codes, recorded = actor["clip"], actor["ratio"]
    factor = {CLIP_NONE: recorded, CLIP_LOW: 1 - u.low, CLIP_HIGH: 1 + u.high, CLIP_DUAL: u.c}
    implied = np.select([codes == code for code in factor], [np.broadcast_to(f, recorded.shape) for f in factor.values()], np.nan)
    scaled = u.weighted_advantage()
    label = lambda row: f"verl's pg_loss against the term of clip {codes[row]!r}"  # noqa: E731
    # verl clamps the ratio to 1 ± ε_clip in the ratio's dtype: in bf16, 0.8 is 0.80078125
    return compare(actor["pg_loss"], -scaled * implied, PG_TERM(scaled, recorded, u.c, u.eps("actor")), u.where(actor, label))


def vf_loss(u: UpdateStep) -> Finding:
    if (unavailable := u.unavailable("critic")) is not None:
        return unavailable
    critic = u.critic
    epsilon = u.settings["critic"]["cliprange_value"]
    vpred, value, ret = critic["vpred"], critic["value"], critic["return"]
    eps = u.eps("critic")
    clipped = np.clip(vpred, value - epsilon, value + epsilon)
    f32 = np.float32
    vp, cl, r = vpred.astype(f32), critic["vpred_clipped"].astype(f32), ret.astype(f32)
    clipped_larger = (cl - r) ** 2 > (vp - r) ** 2  # verl's comparison, in float32
    return combine([
        # clip(vpred, V − ε_v, V + ε_v): V ± ε_v rounds once, in the loss's dtype
        compare(critic["vpred_clipped"], clipped, ELEMENTWISE(np.abs(value) + epsilon, eps), u.where(critic, "vpred_clipped")),
        compare(critic["vf_loss"], np.maximum((vpred - ret) ** 2, (clipped - ret) ** 2),
                VF_TERM(vpred, value, ret, epsilon, eps), u.where(critic, "vf_loss")),
        compare(critic["vf_clipped"], clipped_larger, 0.0, u.where(critic, "vf_clipped")),
    ])  # fmt: skip


def update_metrics(u: UpdateStep) -> Finding:
    """verl's logged update metrics from the per-token terms (docs/definitions.md §8)."""
    if (unavailable := u.unavailable()) is not None:
        return unavailable
    names, logged, reproduced, tolerances = [], [], [], []
    for kind, table, metrics in (("actor", u.actor, _ACTOR_METRICS), ("critic", u.critic, _CRITIC_METRICS)):
        if table is None:
            continue
        record = u.trace.update_record(kind, u.step)
        empty = record.empty_microbatches
        settings = u.settings[kind]
        mode = settings["loss_agg_mode"]
        term = table["pg_loss"] if kind == "actor" else table["vf_loss"]
        largest = max(max((m.get("batch_num_tokens") or 0 for m in record.minibatches), default=0), 1)
        loss = (0.5 if kind == "critic" else 1.0) * _aggregate(table, term, record.minibatches, mode, settings.get("loss_scale_factor"))
        loss_key, clipfrac_key, *more = metrics
        values = {loss_key: (loss, AGGREGATE(largest, float(np.nanmax(np.abs(term))) if len(term) else 0.0))}
        if kind == "actor":
            clipfrac_lower_key, ppo_kl_key = more
            codes = table["clip"]
            values[clipfrac_key] = (_metric_mean(table, (codes == CLIP_LOW) | (codes == CLIP_HIGH), kind, empty), ATOL)
            values[clipfrac_lower_key] = (_metric_mean(table, codes == CLIP_DUAL, kind, empty), ATOL)
            if u.loss_mode == "vanilla":  # verl's ppo_kl: the micro-batch mean of −clamp(Δlog-prob) = −log ratio
                log_ratio = np.log(table["ratio"])
                # verl averages Δlog-prob in the loss's dtype, whose ratio (read here) rounds once more
                eps = u.eps("actor")
                bound = AGGREGATE(largest, float(np.nanmax(np.abs(log_ratio))) if len(log_ratio) else 0.0, eps) + eps
                values[ppo_kl_key] = (_metric_mean(table, -log_ratio, kind, empty), bound)
        else:
            values[clipfrac_key] = (_metric_mean(table, table["vf_clipped"], kind, empty), ATOL)
        for name, (value, tolerance) in values.items():
            if name in record.logged:
                names.append(name)
                logged.append(record.logged[name])
                reproduced.append(value)
                tolerances.append(tolerance)
    if not names:
        return Finding("skipped", note="no logged update metrics recorded")
    return compare(logged, reproduced, np.array(tolerances), lambda i: (Location(u.step), names[i]))


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


def _metric_mean(table, values: np.ndarray, kind: str, empty: list = ()) -> float:
    """A metric verl logs per micro-batch (clip fractions, ppo_kl): a token mean per micro-batch, then
    means over ranks, micro-batches and mini-batches (actor, ``Metric`` MEAN), or one flat mean of all
    micro-batch values (critic). ``empty``: the (epoch, minibatch, microbatch, rank) of loss calls with no
    valid token, whose masked mean verl takes as 0 (Σ/(0 + 1e-8))."""
    groups, inverse = _unique_rows([table[k] for k in ("epoch", "minibatch", "microbatch", "rank")])
    per_micro = np.bincount(inverse, weights=values.astype(np.float64)) / np.bincount(inverse)
    if len(empty):
        groups = np.concatenate([groups.reshape(-1, 4), np.asarray(empty, np.int64).reshape(-1, 4)])
        per_micro = np.concatenate([per_micro, np.zeros(len(empty))])
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
    advantage = floats(table.column("advantage"))[last]
    change = (floats(table.column("log_prob")) - floats(table.column("old_log_prob")))[last]
    return {
        "clip_low": float((clip == CLIP_LOW).mean()),
        "clip_high": float((clip == CLIP_HIGH).mean()),
        "clip_dual": float((clip == CLIP_DUAL).mean()),
        "adv_dlogp_corr": _correlation(advantage, change)[0],
    }


def _correlation(advantage: np.ndarray, change: np.ndarray) -> tuple[float | None, str | None]:
    """(the correlation of the advantage with Δlog-prob, None), or (None, why it is undefined)."""
    if len(change) < 2:
        return None, "its last epoch has fewer than 2 update rows"
    if change.std() == 0:
        if np.any(change != 0):
            return None, "log_prob − old_log_prob is the same on every row of its last epoch"
        return None, (
            "log_prob = old_log_prob on every row of its last epoch: the update computed every log-prob before "
            "the policy moved"
        )
    if advantage.std() == 0:
        return None, "the advantage is the same on every row of its last epoch"
    return float(np.corrcoef(advantage, change)[0, 1]), None


def why_no_correlation(trace, step: int) -> str | None:
    """Why ``adv_dlogp_corr`` of ``step`` is blank (one clause), None when it is not: it needs the
    actor update table and Δlog-prob that varies, i.e. an optimizer step before some mini-batch of
    the last epoch (a learning rate of 0, as on the first step of verl's warm-up, moves nothing)."""
    if step not in trace.update_steps.get("actor", []):
        return "the trace has no actor update table for it (verl_ext.trace.update=false)"
    table = trace.actor_update(step, columns=["epoch", "minibatch", "advantage", "log_prob", "old_log_prob"])
    if not table.num_rows:
        return "its actor update table is empty"
    epoch = table.column("epoch").to_numpy()
    last = epoch == epoch.max()
    advantage = floats(table.column("advantage"))[last]
    change = (floats(table.column("log_prob")) - floats(table.column("old_log_prob")))[last]
    why = _correlation(advantage, change)[1]
    if why is None or not why.startswith("log_prob = old_log_prob"):
        return why
    minibatches = len(np.unique(table.column("minibatch").to_numpy()[last]))
    if epoch.max() == 0 and minibatches == 1:
        return why + " (one mini-batch in one epoch: its only optimizer step comes after them)"
    return why + " (a learning rate of 0, e.g. on the first step of verl's warm-up: actor.optim.lr_warmup_steps starts it at 0)"


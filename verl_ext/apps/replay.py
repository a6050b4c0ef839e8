"""``verl-ext replay``: one recorded step's update run again, offline, as recorded or with other
settings (docs/inspecting.md#replaying-a-step). This module: the overrides, the model-free replay,
another estimator's advantages, and the replay's trace; :mod:`verl_ext.apps.replay_model` runs the
whole update again with verl's workers from the run's checkpoints.

The model-free replay is the first mini-batch of PPO epoch 0. The actor has not stepped when verl
computes that mini-batch's loss, so the log-probs it used are the recorded ones (the update table's
``log_prob``), and verl's own policy-loss function, fed the recorded inputs, gives the loss again. As
recorded, that is a proof that the trace holds the loss's whole input (``REPRODUCED``, or the first
token and column that differ). With overrides it is the what-if: other clip ranges, dual-clip bound,
loss aggregation, policy-loss mode or estimator (the advantages are then re-estimated from the step's
recorded rewards and values, and whitened as the run whitened), or another rollout correction (its
weights and rejection recomputed from the recorded log-probs: :mod:`verl_ext.apps.replay_correction`).
Later mini-batches, the learning rate and the number of epochs need the model; the model-free replay
says so and does not approximate them. The loss multiplies in the weights verl put on the batch, the
token table's ``rollout_is_weight`` (:func:`recorded_weights`), as the model replay does.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from verl_ext.errors import ReplayError, TraceError, one_line

ACTOR = "actor_rollout_ref.actor."
#: override key -> the key of the run record's ``update.actor`` it sets
ACTOR_OVERRIDES = {
    f"{ACTOR}clip_ratio_low": ("clip_ratio_low",),
    f"{ACTOR}clip_ratio_high": ("clip_ratio_high",),
    f"{ACTOR}clip_ratio": ("clip_ratio_low", "clip_ratio_high"),
    f"{ACTOR}clip_ratio_c": ("clip_ratio_c",),
    f"{ACTOR}loss_agg_mode": ("loss_agg_mode",),
    f"{ACTOR}loss_scale_factor": ("loss_scale_factor",),
    f"{ACTOR}policy_loss.loss_mode": ("loss_mode",),
}
#: the update's columns compared as recorded, in the order a difference is reported (is_weight: the weight
#: fed to the loss, the token table's, against the one the recorded loss used)
REPLAYED_COLUMNS = ("ratio", "clip", "is_weight", "pg_loss")
MODEL_FREE = "model-free"


@dataclass
class Overrides:
    """What a replay changes: the actor's loss settings (``update.actor`` keys) and ``algorithm`` keys."""

    given: list[str] = field(default_factory=list)  # as typed, for the record
    actor: dict[str, Any] = field(default_factory=dict)
    algorithm: dict[str, Any] = field(default_factory=dict)
    #: the model replay's: ``key=value`` items for verl's actor and critic config, as given
    config: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, items: list[str], model: bool = False) -> "Overrides":
        """``key=value`` items, values read as YAML (as Hydra reads them); ReplayError on a bad one.
        ``model``: for the model replay, which also takes any ``actor_rollout_ref.*`` and ``critic.*`` key."""
        import yaml

        overrides = cls(given=list(items))
        for item in items:
            key, sep, text = item.partition("=")
            if not sep or not key:
                raise ReplayError(f"override {item!r} is not key=value")
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                raise ReplayError(f"override {item!r}: {text!r} is not a value") from None
            if model and key.startswith(("actor_rollout_ref.", "critic.")):
                overrides.config.append(item)
            if key in ACTOR_OVERRIDES:
                for name in ACTOR_OVERRIDES[key]:
                    overrides.actor[name] = value
            elif key.startswith("algorithm."):
                overrides.algorithm[key.removeprefix("algorithm.")] = value
            elif model and key.startswith(("actor_rollout_ref.", "critic.")):
                continue
            elif model:
                raise ReplayError(f"override {key}: the replay changes the update (actor_rollout_ref.*, critic.*) and the estimator (algorithm.*), not the run")
            elif key.startswith(("actor_rollout_ref.", "critic.", "trainer.", "data.")):
                raise ReplayError(
                    f"override {key}: it changes what happens after the first mini-batch's loss (or the data), and "
                    "replaying that needs the model (a checkpoint: --checkpoint DIR, where the run saved them); "
                    f"model-free the replay takes {', '.join(ACTOR_OVERRIDES)} and algorithm.*"
                )
            else:
                raise ReplayError(f"override {key}: not a verl setting the replay knows (it takes {', '.join(ACTOR_OVERRIDES)} and algorithm.*)")
        for name in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_scale_factor"):
            value = overrides.actor.get(name)
            if name in overrides.actor and not (isinstance(value, (int, float)) and not isinstance(value, bool)) and not (
                name == "loss_scale_factor" and value is None
            ):
                raise ReplayError(f"override {name}={value!r}: expected a number")
        # verl's ActorConfig takes any number; its loss clips the ratio to [1 − low, 1 + high], and asserts c > 1
        for name, bound, why in (
            ("clip_ratio_low", 0, "the ratio's lower clip is 1 − clip_ratio_low"),
            ("clip_ratio_high", 0, "the ratio's upper clip is 1 + clip_ratio_high"),
            ("clip_ratio_c", 1, "the lower bound of dual-clip PPO: verl's loss asserts it"),
        ):
            if name in overrides.actor and not overrides.actor[name] > bound:
                key = next(key for key in reversed(overrides.given) if name in ACTOR_OVERRIDES.get(key.partition("=")[0], ()))
                raise ReplayError(f"override {key}: {name} must be > {bound} ({why}), got {overrides.actor[name]}")
        return overrides


def estimate_overrides(overrides: Overrides) -> dict[str, Any]:
    """The ``algorithm`` overrides other than the rollout correction's: those that change the estimate itself."""
    from verl_ext.apps.replay_correction import correction_keys

    keys = set(correction_keys(overrides.algorithm))
    return {key: value for key, value in overrides.algorithm.items() if key not in keys}


def replayed_correction(trace, algorithm_overrides):
    """:func:`verl_ext.apps.replay_correction.replayed_correction` (imported when called)."""
    from verl_ext.apps import replay_correction

    return replay_correction.replayed_correction(trace, algorithm_overrides)


def replayed_algorithm(trace, overrides: Overrides, correction) -> dict[str, Any]:
    """The run record's ``algorithm`` as replayed: the estimate's overrides, and the rollout correction's
    settings (as the run record keeps them) where an override sets it."""
    algorithm = {**trace.record.algorithm, **estimate_overrides(overrides)}
    if correction.given:
        algorithm["rollout_correction"] = correction.settings()
    return algorithm


def check_overrides(trace, overrides: Overrides, model: bool = False) -> None:
    """The overrides checked against the run before anything is replayed, as a run's driver checks its
    config (ReplayError, one line naming the key and the value): the estimator a known name (the valid
    names listed); an ``algorithm`` key the run's config has or verl-ext declares; verl-ext's estimator
    options (:func:`verl_ext.registry.check_algorithm`); and, where the run record holds the run's config,
    the values given against verl's typed config (:func:`verl_ext.apps.composition.check_types`). With the
    ``model`` (whose workers are built from that config with the overrides) also verl's ``validate_config``."""
    import warnings

    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from verl_ext import registry
    from verl_ext.apps.composition import check_types, verl_validation
    from verl_ext.errors import UsageError
    from verl_ext.integration.validation import known_estimator_names
    from verl_ext.options import ALGORITHM_OPTIONS

    recorded = OmegaConf.create(trace.record.config) if trace.record.config is not None else None
    if "adv_estimator" in overrides.algorithm:
        name = registry.name_of(overrides.algorithm["adv_estimator"])
        valid = known_estimator_names()
        if name not in valid:
            raise ReplayError(f"algorithm.adv_estimator={name!r} is not a known advantage estimator. Valid names: {', '.join(sorted(valid))}")
    declared = {option.key for option in (*ALGORITHM_OPTIONS, *(o for e in registry.all_estimators() for o in e.options))}
    has = (recorded.get("algorithm") if recorded is not None else None) or OmegaConf.create(dict(trace.record.algorithm))
    for key in overrides.algorithm:
        if key.partition(".")[0] not in declared and OmegaConf.select(has, key, default=KeyError) is KeyError:
            parent = key.rpartition(".")[0]
            node = OmegaConf.select(has, parent, default=None) if parent else has
            names = [f"{parent}.{k}" if parent else str(k) for k in node.keys()] if OmegaConf.is_dict(node) else []
            nearest = difflib.get_close_matches(key, names, n=1, cutoff=0.6)
            hint = f": did you mean algorithm.{nearest[0]}?" if nearest else ""
            raise ReplayError(f"override algorithm.{key}: not a key of the run's algorithm config{hint}")
    estimator_overrides = estimate_overrides(overrides)
    if estimator_overrides:
        with warnings.catch_warnings():  # an option the estimator ignores: the report lists the overrides
            warnings.simplefilter("ignore")
            try:
                registry.check_algorithm({**trace.record.algorithm, **estimator_overrides})
            except ValueError as error:
                raise ReplayError(one_line(error)) from None
    replayed_correction(trace, overrides.algorithm)  # a value verl refuses, bypass mode: one line
    if recorded is None or not overrides.given:
        return
    try:
        merged = OmegaConf.merge(recorded, OmegaConf.from_dotlist(overrides.given))
        check_types(merged, keys=[item.partition("=")[0] for item in overrides.given])
        if model and overrides.config and _validates(recorded):
            verl_validation(merged)
    except OmegaConfBaseException as error:
        raise ReplayError(f"overrides {' '.join(overrides.given)}: {one_line(error)}") from None
    except UsageError as error:
        raise ReplayError(str(error)) from None


def _validates(recorded) -> bool:
    """Whether verl's validate_config takes the run's config as recorded: the config a trainer held while it
    ran, which verl changed after validating it (the legacy trainer's reference policy loses its log_prob_*
    keys, which validate_config reads), so that only an override's own refusal is the override's."""
    from verl_ext.apps.composition import verl_validation
    from verl_ext.errors import UsageError

    try:
        verl_validation(recorded)
    except UsageError:
        return False
    return True


@dataclass
class Replay:
    """One step's first mini-batch scored again. ``recorded`` and ``replayed`` are its update rows
    (the actor update table's columns), in the same order; ``weight`` is ∂(mini-batch loss)/∂(term)
    of each row as recorded and as replayed (how much of the loss each token's term carries)."""

    trace_path: str
    step: int
    overrides: Overrides
    settings: dict[str, Any]  # update.actor as replayed
    algorithm: dict[str, Any]  # algorithm as replayed
    recorded: pa.Table
    replayed: pa.Table
    recorded_loss: float
    replayed_loss: float
    recorded_weight: np.ndarray
    replayed_weight: np.ndarray
    #: the tokens the step's whole update trained in epoch 0, and how many the first mini-batch holds
    epoch_tokens: int
    #: the as-recorded verdict: None (REPRODUCED) or (sample, token_index, column, recorded, replayed)
    difference: tuple[int, int, str, Any, Any] | None
    bitwise: int  # rows whose replayed columns equal the recorded ones bit for bit (as recorded)
    #: the step's token table with the advantages the replay used (re-estimated) and another rollout
    #: correction's mask, rejection and weights; None when unchanged
    tokens: pa.Table | None = None
    whiten: dict[str, float] | None = None
    #: the mini-batch's global batch information the replayed loss normalised with (verl's, with the
    #: trained tokens another rollout correction leaves)
    info: dict[str, Any] | None = None
    #: what another rollout correction changed (verl_ext.apps.replay_correction.CorrectionChange); None: the run's
    correction: Any = None
    #: where the weights the recorded loss multiplied in came from: "tokens" (the token table's
    #: rollout_is_weight), "update" (the update table's is_weight: a trace before format 10), None (none)
    weights_from: str | None = None
    #: where the update sits in an asynchronous run, and the mode (:func:`update_place`); None: a synchronous run's
    place: str | None = None

    @property
    def reproduced(self) -> bool:
        return self.difference is None


def replay_step(trace, step: int, overrides: Overrides) -> Replay:
    """The model-free replay of ``step`` of ``trace`` (module docstring)."""
    from verl_ext.trace.schema import UPDATE_SCHEMAS

    trace.require_step(step)
    if step not in trace.update_steps.get("actor", []):
        raise ReplayError(
            f"step {step} of {trace.path} has no actor update table: a replay needs what the update did "
            "(verl_ext.trace.update=true, and a step whose update finished)"
        )
    check_overrides(trace, overrides)
    recorded_settings = dict((trace.record.update or {}).get("actor") or {})
    if not recorded_settings:
        raise ReplayError(f"{trace.path}: the run record does not say how the actor computed its loss (a trace before format 2)")
    settings = {**recorded_settings, **overrides.actor}
    correction = replayed_correction(trace, overrides.algorithm)
    algorithm = replayed_algorithm(trace, overrides, correction)
    entry = trace.update_record("actor", step)
    info = {(m["epoch"], m["minibatch"]): m for m in entry.minibatches}.get((0, 0))
    table = trace.actor_update(step)
    epoch_tokens = int(np.sum(table["epoch"].to_numpy() == 0))
    first = pa.compute.and_(pa.compute.equal(table["epoch"], 0), pa.compute.equal(table["minibatch"], 0))
    rows = table.filter(first)
    if info is None or rows.num_rows == 0:
        raise ReplayError(f"step {step}: the actor update table has no mini-batch 0 of epoch 0")
    step_tokens = trace.read_step(step)
    weights, weights_from = recorded_weights(step_tokens, rows)
    as_recorded = _score(rows, recorded_settings, rows["advantage"].to_numpy(), info, weights)
    difference, bitwise = _first_difference(rows, as_recorded.columns, recorded_settings)
    tokens, whiten, change, replay_rows, replay_info = None, None, None, rows, info
    if correction.given:
        from verl_ext.apps.replay_correction import corrected_tokens

        tokens, change = corrected_tokens(trace, step, correction)
        if change.mask_changed:
            replay_rows, replay_info = first_minibatch_under(tokens, table, rows, info, step, trace.record.trainer == "v1")
        weights, _ = recorded_weights(tokens, replay_rows)
    advantages = replay_rows["advantage"].to_numpy()
    if estimate_overrides(overrides) or (change is not None and change.mask_changed):
        tokens, whiten, advantages = reestimated_tokens(trace, step, algorithm, replay_rows, tokens)
    given = bool(overrides.actor or overrides.algorithm)
    replayed = _score(replay_rows, settings, advantages, replay_info, weights) if given else as_recorded
    replayed_table = replay_rows
    for name, values in {"advantage": advantages, **replayed.columns}.items():
        field_ = UPDATE_SCHEMAS["actor"].field(name)
        replayed_table = replayed_table.set_column(replayed_table.schema.get_field_index(name), field_, pa.array(values, field_.type, from_pandas=True))
    return Replay(
        trace_path=str(trace.path), step=step, overrides=overrides, settings=settings, algorithm=algorithm,
        recorded=rows, replayed=replayed_table, recorded_loss=as_recorded.loss, replayed_loss=replayed.loss,
        recorded_weight=as_recorded.weight, replayed_weight=replayed.weight, epoch_tokens=epoch_tokens,
        difference=difference, bitwise=bitwise, tokens=tokens, whiten=whiten, info=dict(replay_info), correction=change,
        weights_from=weights_from, place=update_place(trace, step),
    )  # fmt: skip


def update_place(trace, step: int) -> str | None:
    """``verl step 2, update 2 of 2, trainer version 1; mode separate_async (parameter_sync_step=2)``: where the
    update of trace step ``step`` sits in an asynchronous run (docs/definitions.md#policy-versions); None for a
    synchronous run's."""
    from verl_ext.steps.versions import StepPlace, describe_mode, may_be_asynchronous

    if not may_be_asynchronous(trace.record):
        return None
    place = StepPlace.of(trace, step).describe()
    return None if place is None else f"{place}; mode {describe_mode(trace.record.mode) or 'not recorded'}"


def recorded_weights(tokens: pa.Table, rows: pa.Table) -> tuple[np.ndarray | None, str | None]:
    """The rollout weights verl's loss multiplied into each of ``rows``' terms (its ``rollout_is_weights``):
    the token table's ``rollout_is_weight`` at the rows' tokens (0 where null), as the model replay puts it
    on the batch; a trace before format 10, which lacks it, has them in the update table's ``is_weight``
    only. (None, None) where the run applied none. The second item says which: "tokens" or "update"."""
    from verl_ext.steps.layout import floats, join_keys, locate

    column = tokens["rollout_is_weight"]
    if column.null_count < len(column):
        index, found = locate(join_keys(tokens["sample"].to_numpy(), tokens["token_index"].to_numpy()),
                              join_keys(rows["sample"].to_numpy(), rows["token_index"].to_numpy()))  # fmt: skip
        if not found.all():
            raise ReplayError("the update table trains tokens the token table does not hold")
        return floats(column.fill_null(0.0), np.float32)[index], "tokens"
    if rows["is_weight"].null_count < rows.num_rows:
        return floats(rows["is_weight"], np.float32), "update"
    return None, None


def first_minibatch_under(
    tokens: pa.Table, table: pa.Table, rows: pa.Table, info: Mapping[str, Any], step: int, counts_rejected: bool = False,
) -> tuple[pa.Table, dict]:
    """The first mini-batch's rows when the mask is ``tokens``' (another rollout correction's): the same
    samples in the same micro-batches (verl batches samples, whatever their mask), with the tokens the new
    mask keeps. A token newly kept has no recorded row: its log-prob is its ``old_log_prob`` (the actor has
    not stepped in this mini-batch), its advantage set by the caller, its entropy unknown (null). And the
    mini-batch's global information with its new count of trained tokens, the token-mean's denominator;
    ``counts_rejected`` (verl's V1 trainer): the recorded one, which counts the rejected tokens too
    (docs/definitions.md#off-policy-tokens)."""
    from verl_ext.steps.layout import join_keys, locate

    sample, index = rows["sample"].to_numpy(), rows["token_index"].to_numpy()
    samples, first_row = np.unique(sample, return_index=True)
    placed = table["sample"].to_numpy()
    mask, token_sample = tokens["mask"].to_numpy(zero_copy_only=False), tokens["sample"].to_numpy()
    unplaced = np.setdiff1d(np.unique(token_sample[mask]), np.unique(placed[table["epoch"].to_numpy() == 0]))
    if len(unplaced):
        raise ReplayError(
            f"step {step}: the new rollout correction keeps tokens of sample {int(unplaced[0])}, none of whose tokens the run trained, so "
            "the trace does not say which mini-batch verl put it in; with the model (--checkpoint DIR) verl's own mini-batching places it"
        )
    kept = mask & np.isin(token_sample, samples)
    keys = join_keys(token_sample[kept], tokens["token_index"].to_numpy()[kept])
    at, found = locate(join_keys(sample, index), keys)
    # rows in the recorded order of their samples, each sample's tokens in order
    order = np.lexsort((tokens["token_index"].to_numpy()[kept], first_row[np.searchsorted(samples, token_sample[kept])]))
    at, found, kept_rows = at[order], found[order], np.flatnonzero(kept)[order]
    source = rows.take(pa.array(np.where(found, at, 0)))
    columns = {name: source[name].to_pylist() for name in rows.column_names}
    first_of = dict(zip(samples.tolist(), first_row.tolist()))
    for i in np.flatnonzero(~found):
        row, of = int(kept_rows[i]), first_of[int(token_sample[kept_rows[i]])]
        old = tokens["old_log_prob"][row].as_py()
        for name in rows.column_names:
            columns[name][i] = {
                "sample": int(token_sample[row]), "token_index": int(tokens["token_index"][row].as_py()), "log_prob": old,
                "old_log_prob": old, "entropy": None, "ratio": None, "pg_loss": None, "clip": None, "advantage": None, "is_weight": None,
            }.get(name, rows[name][of].as_py())  # fmt: skip
    replayed = pa.table(columns, schema=rows.schema)
    counted = info.get("batch_num_tokens")
    if counted is not None and not counts_rejected:
        counted = int(counted) + replayed.num_rows - rows.num_rows
    return replayed, {**info, "batch_num_tokens": counted}


# --------------------------------------------------------------------------- verl's loss, again


@dataclass
class _Scored:
    columns: dict[str, np.ndarray]  # ratio, clip, pg_loss, is_weight (the weight fed; NaN: none) per row
    loss: float  # the mini-batch's policy loss: Σ over its micro-batches of verl's agg_loss
    weight: np.ndarray  # ∂loss/∂(term) per row


def _score(rows: pa.Table, settings: Mapping[str, Any], advantages: np.ndarray, info: Mapping[str, Any], weights: np.ndarray | None) -> _Scored:
    """verl's policy-loss function (``core_algos.get_policy_loss_fn``) on each micro-batch of ``rows``,
    padded per sample as verl's loss receives them, with ``weights`` (one per row; None: none) as its
    ``rollout_is_weights``; the per-token term is the matrix verl hands ``agg_loss``, and ratio and clip
    are verl's vanilla expressions (update_hook.ratio_and_clip)."""
    import torch
    from omegaconf import OmegaConf
    from verl.trainer.ppo import core_algos

    from verl_ext.integration.update_hook import CLIP_NAMES, recording_loss, ratio_and_clip

    mode, aggregation = settings.get("loss_mode", "vanilla"), settings["loss_agg_mode"]
    if aggregation == "seq-mean-token-sum-norm" and settings.get("loss_scale_factor") is None:
        raise ReplayError(
            "loss_agg_mode=seq-mean-token-sum-norm without loss_scale_factor divides by verl's padded response "
            "width, which the trace does not hold: give actor_rollout_ref.actor.loss_scale_factor=<n>"
        )
    try:
        policy_loss = core_algos.get_policy_loss_fn(mode)
    except (KeyError, ValueError) as error:
        raise ReplayError(f"policy_loss.loss_mode={mode!r}: {error}") from None
    batch_info = {
        "dp_size": int(info.get("dp_size") or 1),
        "batch_num_tokens": info.get("batch_num_tokens"),
        "global_batch_size": info.get("global_batch_size"),
        "loss_scale_factor": settings.get("loss_scale_factor"),
    }
    config = OmegaConf.create({
        "clip_ratio": settings["clip_ratio_high"], "clip_ratio_low": settings["clip_ratio_low"],
        "clip_ratio_high": settings["clip_ratio_high"], "clip_ratio_c": settings["clip_ratio_c"],
        "loss_agg_mode": aggregation, "policy_loss": {"loss_mode": mode}, "global_batch_info": batch_info,
    })  # fmt: skip
    n = rows.num_rows
    ratio, pg_loss, weight = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.float64)
    clip = np.empty(n, object)
    loss = 0.0
    sample, token_index = rows["sample"].to_numpy(), rows["token_index"].to_numpy()
    group_keys = np.stack([rows["rank"].to_numpy(), rows["microbatch"].to_numpy()], axis=1)
    for key in np.unique(group_keys, axis=0):
        at = np.flatnonzero((group_keys == key).all(axis=1))
        samples, row_of = np.unique(sample[at], return_inverse=True)
        shape = (len(samples), int(token_index[at].max()) + 1)

        def dense(values, fill=0.0, dtype=torch.float32):
            matrix = torch.full(shape, fill, dtype=dtype)
            matrix[row_of, token_index[at]] = torch.as_tensor(np.asarray(values)[at], dtype=dtype)
            return matrix

        log_prob, old_log_prob = dense(rows["log_prob"].to_numpy()), dense(rows["old_log_prob"].to_numpy())
        advantage, mask = dense(advantages), dense(np.ones(n, bool), False, torch.bool)
        seen: dict[str, Any] = {}
        try:
            with recording_loss(core_algos, seen), torch.no_grad():
                total, _ = policy_loss(
                    old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantage, response_mask=mask,
                    loss_agg_mode=aggregation, config=config, rollout_is_weights=None if weights is None else dense(weights, 1.0),
                )  # fmt: skip
        except (AssertionError, AttributeError, KeyError, TypeError, ValueError) as error:
            # a loss mode that reads settings the run record lacks, or asserts verl's own ActorConfig object
            raise ReplayError(
                f"policy_loss.loss_mode={mode}: verl's loss function does not run on the settings the trace records "
                f"({one_line(error)}); the model-free replay runs vanilla and the modes that read only the clip settings"
            ) from None
        loss += float(total)
        term = seen["loss_mat"].detach().clone().requires_grad_(True)
        (gradient,) = torch.autograd.grad(core_algos.agg_loss(loss_mat=term, loss_mask=mask, loss_agg_mode=aggregation, **batch_info), term)
        step_ratio, step_clip = ratio_and_clip(log_prob, old_log_prob, advantage, settings["clip_ratio_low"], settings["clip_ratio_high"], settings["clip_ratio_c"])
        cells = (torch.as_tensor(row_of), torch.as_tensor(token_index[at]))
        ratio[at], pg_loss[at] = step_ratio[cells].numpy(), seen["loss_mat"][cells].float().numpy()
        clip[at], weight[at] = CLIP_NAMES[step_clip[cells].numpy()], gradient[cells].double().numpy()
    fed = np.full(n, np.nan, np.float32) if weights is None else np.asarray(weights, np.float32)
    return _Scored({"ratio": ratio, "clip": clip, "pg_loss": pg_loss, "is_weight": fed}, loss, weight)


def _first_difference(rows: pa.Table, columns: Mapping[str, np.ndarray], settings) -> tuple[tuple | None, int]:
    """The as-recorded verdict: the first row (in the table's order) and column where the replay
    differs from the recorded update beyond the checker's tolerances for the loss's dtype
    (docs/definitions.md#tolerances); and how many rows equal bit for bit."""
    from verl_ext.check.results import DTYPE_EPS, EPS32
    from verl_ext.check.update_checks import PG_TERM, RATIO

    eps = DTYPE_EPS.get(settings.get("dtype"), EPS32)
    recorded = {name: rows[name].to_numpy(zero_copy_only=False) for name in REPLAYED_COLUMNS}
    recorded["is_weight"] = rows["is_weight"].fill_null(np.nan).to_numpy(zero_copy_only=False).astype(np.float32)
    fed = np.asarray(columns["is_weight"], np.float32)
    # the weight is a copy, not a computation: the same number, or none on both sides
    same_weight = (fed.view(np.uint32) == recorded["is_weight"].view(np.uint32)) | (np.isnan(fed) & np.isnan(recorded["is_weight"]))
    delta = np.clip(rows["log_prob"].to_numpy() - rows["old_log_prob"].to_numpy(), -20, 20)
    close = {
        "ratio": np.abs(columns["ratio"] - recorded["ratio"]) <= RATIO(recorded["ratio"], delta, eps),
        "clip": columns["clip"] == recorded["clip"],
        "pg_loss": np.abs(columns["pg_loss"] - recorded["pg_loss"])
        <= PG_TERM(rows["advantage"].to_numpy() * np.where(np.isnan(recorded["is_weight"]), 1.0, recorded["is_weight"]), recorded["ratio"], settings["clip_ratio_c"], eps),
        "is_weight": same_weight,
    }
    same = np.ones(rows.num_rows, bool)
    for name in ("ratio", "pg_loss"):
        same &= columns[name].view(np.uint32) == recorded[name].astype(np.float32).view(np.uint32)
    same &= close["clip"] & same_weight
    bad = np.zeros(rows.num_rows, bool)
    for name in REPLAYED_COLUMNS:
        bad |= ~close[name]
    if not bad.any():
        return None, int(same.sum())
    row = int(np.argmax(bad))
    name = next(name for name in REPLAYED_COLUMNS if not close[name][row])
    where = (int(rows["sample"][row].as_py()), int(rows["token_index"][row].as_py()))
    return (*where, name, recorded[name][row], columns[name][row]), int(same.sum())


# --------------------------------------------------------------------------- another estimator


def reestimated_tokens(
    trace, step: int, algorithm: Mapping[str, Any], rows: pa.Table | None, table: pa.Table | None = None
) -> tuple[pa.Table, dict | None, np.ndarray | None]:
    """The step's token table (``table``: that one, e.g. with another rollout correction's mask; else the
    trace's) with ``algorithm``'s returns and advantages (raw, then whitened as the run whitened, over the
    step's valid tokens), its whitening statistics, and the advantages at ``rows`` (None without rows),
    made as the run made its own (:func:`verl_ext.steps.as_run.as_run`)."""
    from types import SimpleNamespace

    from verl_ext.steps.as_run import as_run
    from verl_ext.steps.cuts import StepCuts
    from verl_ext.steps.layout import LAYOUT_COLUMNS, StepData, join_keys, locate
    from verl_ext.steps.recorded import RecordedAlgorithm

    try:
        recorded = RecordedAlgorithm.from_record(SimpleNamespace(algorithm=dict(algorithm), rollout=trace.record.rollout))
    except TraceError as error:
        raise ReplayError(f"algorithm overrides: {str(error).removeprefix('run record: ')}") from None
    if not recorded.recomputable:
        raise ReplayError(f"algorithm.adv_estimator={recorded.name}: {recorded.why_not}")
    entry = trace.step_record(step)
    if entry.samples < entry.batch_samples:
        raise ReplayError(
            f"step {step} traced {entry.samples} of its {entry.batch_samples} samples: another estimator's advantages are "
            "whitened over the whole batch, which the trace does not hold (trace every sample: verl_ext.trace.max_samples_per_step)"
        )
    table = trace.read_step(step) if table is None else table
    if recorded.estimator.needs_critic and table["value"].filter(table["mask"]).null_count:
        raise ReplayError(f"algorithm.adv_estimator={recorded.name} needs the critic's values, and step {step} has none (a critic-free run)")
    data = StepData.from_table(step, table, [*LAYOUT_COLUMNS, "reward", "value"])
    try:
        treated = as_run(data, recorded, StepCuts.read(trace, step, data.layout), mode=recorded.truncation)
    except ValueError as error:
        raise ReplayError(str(error)) from None
    advantages, whiten = treated.advantages, None
    if treated.whitened_tokens is not None:
        if treated.whitening is None:
            raise ReplayError(f"step {step}: fewer than two tokens to whiten the advantages over")
        whiten = treated.whitening.statistics()
    valid = data.layout.valid_rows
    columns = {"advantage_raw": treated.advantage_raw, "advantage": advantages, "return": treated.returns}
    for name, values in columns.items():
        full = np.full(table.num_rows, np.nan)
        full[valid] = values
        array = pa.array(full.astype(np.float32), table.schema.field(name).type, mask=~np.isin(np.arange(table.num_rows), valid))
        table = table.set_column(table.schema.get_field_index(name), table.schema.field(name), array)
    if rows is None:
        return table, whiten, None
    index, found = locate(join_keys(data.layout.sample_ids[data.layout.row_sample[valid]], data.layout.token_index[valid]),
                          join_keys(rows["sample"].to_numpy(), rows["token_index"].to_numpy()))  # fmt: skip
    if not found.all():
        raise ReplayError(f"step {step}: the update table trains tokens the token table does not hold as valid")
    return table, whiten, advantages[index].astype(np.float32)


# --------------------------------------------------------------------------- the replayed trace


def write_replay(replay: Replay, trace, out: str) -> Path:
    """The model-free replay as a trace at ``out`` (:func:`write_replay_trace`): the replayed mini-batch
    is its actor update table."""
    from verl_ext.trace.schema import LAYOUT, UpdateEntry

    step = replay.step
    update = UpdateEntry(
        kind="actor", rows=replay.replayed.num_rows, file=LAYOUT.update_file("actor", step),
        written_at=trace.update_record("actor", step).written_at, logged={},
        minibatches=[replay.info] if replay.info is not None else
                    [m for m in trace.update_record("actor", step).minibatches if (m["epoch"], m["minibatch"]) == (0, 0)],
    )  # fmt: skip
    return write_replay_trace(
        trace, step, out, algorithm=replay.algorithm, update={**(trace.record.update or {}), "actor": dict(replay.settings)},
        updates={"actor": (replay.replayed, update)}, tokens=replay.tokens, whiten=replay.whiten,
        replay={"of": replay.trace_path, "step": step, "mode": MODEL_FREE, "overrides": replay.overrides.given, "minibatches": [[0, 0]]},
        correction_changed=replay.correction is not None,
    )  # fmt: skip


def write_replay_trace(trace, step: int, out: str, *, algorithm, update, updates, tokens, whiten, replay, correction_changed: bool = False) -> Path:
    """A trace at ``out`` holding the replayed ``step``: its token and prompt files (``tokens``, the token
    table with re-estimated advantages, when given; else the trace's), ``updates`` ({kind: (table,
    UpdateEntry)}) as its update tables, and a run record with the replayed ``algorithm`` and ``update``
    settings and ``replay`` saying what it is. ``correction_changed``: another rollout correction was
    replayed, so verl's logged ``rollout_corr/…`` numbers of the run's are left out of the step's entry.
    ``check``, ``show`` and ``view`` read it; an existing non-empty ``out`` is refused."""
    from verl_ext.trace.schema import LAYOUT, RUN_RECORD, STEP_RECORD_METADATA_KEY, TOKEN_SCHEMA, UPDATE_RECORD_METADATA_KEY, UPDATE_SCHEMAS

    root = Path(out)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ReplayError(f"--out {out} exists and is not an empty directory: the replay writes a new trace there")
    source = trace.local_root
    if source is None:
        raise ReplayError(f"{trace.path} is not on this machine's disk: --out copies its step files")
    step_entry = dataclasses.replace(trace.step_record(step), updates={}, file=LAYOUT.token_file(step), prompts_file=LAYOUT.prompt_file(step))
    if whiten is not None:
        step_entry.whiten = whiten
    if correction_changed:  # verl's numbers of the run's correction, not of the replayed one (no driver ran it)
        step_entry.logged = {key: value for key, value in step_entry.logged.items() if not key.startswith("rollout_corr/")}
    (root / LAYOUT.step_dir(step)).mkdir(parents=True)
    (root / LAYOUT.prompt_file(step)).parent.mkdir(parents=True)
    shutil.copyfile(Path(source) / trace.layout.prompt_file(step), root / LAYOUT.prompt_file(step))
    if tokens is None and trace.layout == LAYOUT:
        shutil.copyfile(Path(source) / trace.layout.token_file(step), root / LAYOUT.token_file(step))
    else:
        tokens = tokens if tokens is not None else trace.read_step(step)
        footer = dict(pq.read_metadata(Path(source) / trace.layout.token_file(step)).metadata or {})
        footer[STEP_RECORD_METADATA_KEY.encode()] = json.dumps(dataclasses.asdict(step_entry)).encode()
        pq.write_table(tokens.cast(TOKEN_SCHEMA).replace_schema_metadata({**(TOKEN_SCHEMA.metadata or {}), **footer}), root / LAYOUT.token_file(step))
    for kind, (table, entry) in updates.items():
        schema = UPDATE_SCHEMAS[kind]
        footer = {UPDATE_RECORD_METADATA_KEY: json.dumps(dataclasses.asdict(entry))}
        (root / entry.file).parent.mkdir(parents=True)
        pq.write_table(table.cast(schema).replace_schema_metadata({**(schema.metadata or {}), **footer}), root / entry.file)
        step_entry.updates[kind] = entry
    record = dataclasses.replace(
        trace.record, algorithm=dict(algorithm), update=update, steps={str(step): step_entry}, schema_version=LAYOUT.schema_version, replay=replay
    )
    (root / RUN_RECORD).write_bytes(record.to_json())
    return root


# --------------------------------------------------------------------------- the report


def replay_report(replay: Replay, fmt: str = "text", top: int = 10) -> str:
    """The verdict as recorded, and with overrides what moved: the clip codes that changed, the
    mini-batch's loss, and the ``top`` tokens whose weighted loss term (term × ∂loss/∂term) moved most;
    under another rollout correction what it changed, and the tokens the mini-batch trains only on one
    side (joined on sample and token)."""
    from verl_ext.steps.layout import join_keys, locate

    recorded, replayed = replay.recorded, replay.replayed
    recorded_keys = join_keys(recorded["sample"].to_numpy(), recorded["token_index"].to_numpy())
    replayed_keys = join_keys(replayed["sample"].to_numpy(), replayed["token_index"].to_numpy())
    keys = np.concatenate([recorded_keys, replayed_keys[~np.isin(replayed_keys, recorded_keys)]])
    at_recorded, in_recorded = locate(recorded_keys, keys)
    at_replayed, in_replayed = locate(replayed_keys, keys)

    def side(table, at, present, name, scale=None):
        values = table[name].to_numpy(zero_copy_only=False)
        values = values.astype(np.float64) * scale if scale is not None else values
        return [values[i] if ok else None for i, ok in zip(at, present)]

    carried_before = np.array([0.0 if v is None else v for v in side(recorded, at_recorded, in_recorded, "pg_loss", replay.recorded_weight)])
    carried_after = np.array([0.0 if v is None else v for v in side(replayed, at_replayed, in_replayed, "pg_loss", replay.replayed_weight)])
    change = np.abs(carried_after - carried_before)
    moved = [i for i in np.argsort(-change, kind="stable")[:top] if change[i] > 0]
    both = in_recorded & in_replayed
    transitions = clip_transitions(recorded["clip"].to_numpy(zero_copy_only=False)[at_recorded[both]],
                                   replayed["clip"].to_numpy(zero_copy_only=False)[at_replayed[both]])  # fmt: skip
    columns = {name: (side(recorded, at_recorded, in_recorded, name), side(replayed, at_replayed, in_replayed, name))
               for name in ("advantage", "ratio", "clip")}  # fmt: skip
    moved_rows = [
        {
            "sample": int(keys[i] >> 32), "token_index": int(keys[i] & 0xFFFFFFFF),
            "advantage": [_number_or_none(columns["advantage"][0][i]), _number_or_none(columns["advantage"][1][i])],
            "ratio": _number_or_none(columns["ratio"][1][i]),
            "clip": [columns["clip"][0][i], columns["clip"][1][i]],
            "loss": [float(carried_before[i]), float(carried_after[i])],
        }  # fmt: skip
        for i in moved
    ]
    verdict = "REPRODUCED" if replay.reproduced else "DIFFERS"
    trained = {"replayed": replayed.num_rows, "only_recorded": int((in_recorded & ~in_replayed).sum()), "only_replayed": int((in_replayed & ~in_recorded).sum())}
    data = {
        "trace": replay.trace_path, "step": replay.step, "mode": MODEL_FREE, "tokens": recorded.num_rows,
        "epoch_tokens": replay.epoch_tokens, "as_recorded": verdict, "bitwise": replay.bitwise, "weights": replay.weights_from,
        "difference": None if replay.difference is None else dict(zip(("sample", "token_index", "column", "recorded", "replayed"), _plain(replay.difference))),
        "overrides": replay.overrides.given, "loss": [replay.recorded_loss, replay.replayed_loss],
        "clip_changes": transitions, "moved": moved_rows if replay.overrides.given else [],
        "correction": None if replay.correction is None else replay.correction.as_dict(), "trained": trained,
        **({} if replay.place is None else {"update": replay.place}),
    }  # fmt: skip
    if fmt == "json":
        return json.dumps(data, indent=1)
    lines = [
        f"step {replay.step} of {replay.trace_path}, model-free: PPO epoch 0, mini-batch 0 ({recorded.num_rows} of the "
        f"epoch's {replay.epoch_tokens} tokens). The actor had not stepped yet, so the recorded log-probs are its log-probs; "
        "later mini-batches need the model after each optimizer step and are not replayed.",
    ]
    if replay.place is not None:
        lines.append(f"the update: {replay.place}")
    weights = {
        "tokens": "the token table's rollout_is_weight the weights it multiplied in, as the update table's is_weight says; ",
        "update": "the update table's is_weight the weights it multiplied in: the trace's format has no rollout_is_weight; ",
    }.get(replay.weights_from, "")  # fmt: skip
    if replay.reproduced:
        lines.append(f"as recorded: REPRODUCED: ratio, clip and pg_loss of {recorded.num_rows} tokens are verl's policy loss "
                     f"recomputed from the recorded inputs ({weights}{replay.bitwise} bit for bit, the rest within docs/definitions.md#tolerances)")  # fmt: skip
    else:
        sample, token, column, before, after = replay.difference
        lines.append(f"as recorded: DIFFERS at sample {sample}, token {token}: {column} recorded {before}, replayed {after}")
    if not replay.overrides.given:
        return "\n".join(lines)
    lines.append(f"with {' '.join(replay.overrides.given)}:")
    if replay.correction is not None:
        lines.append(replay.correction.line())
    if trained["only_recorded"] or trained["only_replayed"]:
        noise = np.abs(recorded["log_prob"].to_numpy().astype(np.float64) - recorded["old_log_prob"].to_numpy()).max()
        newly = (f", whose log-prob is their old_log_prob (the actor had not stepped; on the recorded tokens here "
                 f"|log_prob − old_log_prob| ≤ {noise:.3g})") if trained["only_replayed"] else ""  # fmt: skip
        lines.append(f"  the mini-batch trains {replayed.num_rows} tokens (the run's {recorded.num_rows}): {trained['only_recorded']} no longer, "
                     f"{trained['only_replayed']} newly{newly}")  # fmt: skip
    lines.append(f"  mini-batch policy loss (verl's agg_loss, summed over micro-batches): {replay.recorded_loss:.6g} → {replay.replayed_loss:.6g}")
    lines.append(clip_changes_line(transitions) + (" (on the tokens both train)" if trained["only_recorded"] or trained["only_replayed"] else ""))
    if not moved_rows:
        lines.append("  no token's loss moved (in this mini-batch the ratio is 1 up to recomputation noise, so a clip range changes nothing)")
        return "\n".join(lines)
    lines.append("  tokens whose loss moved most (term × ∂loss/∂term, recorded → replayed; —: not trained on that side):")
    lines.append(f"    {'sample':>6} {'token':>5} {'advantage':>21} {'ratio':>8} {'clip':>11} {'loss':>25}")
    for row in moved_rows:
        (a0, a1), (c0, c1) = row["advantage"], row["clip"]
        lines.append(
            f"    {row['sample']:>6} {row['token_index']:>5} {_cell(a0, '9.4f'):>9} → {_cell(a1, '9.4f'):<9} "
            f"{_cell(row['ratio'], '8.4f'):>8} {c0 or '—':>4} → {c1 or '—':<4} {row['loss'][0]:>11.4g} → {row['loss'][1]:<11.4g}"
        )
    return "\n".join(lines)


def _number_or_none(value) -> float | None:
    return None if value is None else float(value)


def _cell(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def clip_transitions(recorded: np.ndarray, replayed: np.ndarray) -> dict[str, int]:
    """"recorded→replayed": how many rows changed clip code so, of two aligned columns of codes."""
    changed = recorded != replayed
    codes, counts = np.unique(np.char.add(np.char.add(recorded[changed].astype(str), "→"), replayed[changed].astype(str)), return_counts=True)
    return {str(code): int(count) for code, count in zip(codes, counts)}


def clip_changes_line(transitions: dict[str, int]) -> str:
    """The reports' line of :func:`clip_transitions`' counts."""
    return "  clip codes changed: " + (", ".join(f"{k} on {v}" for k, v in sorted(transitions.items())) or "none")


def _plain(values) -> list:
    return [value.item() if isinstance(value, np.generic) else value for value in values]

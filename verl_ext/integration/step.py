"""One training step of verl-ext: what it does at verl's advantage step, in order, on both trainers.

verl's trainers reach verl-ext at their advantage step: the legacy trainer calls ``compute_advantage``;
the V1 trainer calls its ``_compute_advantage``, which reads the batch from TransferQueue, calls
``compute_advantage`` and stores the results. :mod:`verl_ext.integration.patches` hands both here. A
step is this story, told by :func:`advantage` with locals and returned as a frozen :class:`Estimated`:

1. place the per-turn rewards on the token rewards (``verl_ext.turn_rewards``), before any estimator;
2. estimate: verl-ext's estimator with the critic's values, or verl's own; the responses cut at the
   length limit treated as ``algorithm.truncation`` says; the whitening's statistics are those of the
   whitening that happened (verl's own estimators: computed apart, over what verl whitened);
3. the live metrics (``verl_ext.step_metrics``; the option ``verl_ext.metrics`` turns them off);
4. the non-finite check (``verl_ext.nonfinite``), raised once the step is captured and written.

Then :func:`captured` makes the trace's capture of the step from that result, a pure function (on V1
once verl has stored the batch), and the caller hands the writer the capture and the metrics to the
one that merges them: V1's ``_compute_advantage`` takes its step's metrics dict; the legacy trainer
merges its step's metrics in ``compute_data_metrics``, later in its ``fit()``.

The step reads verl's batch from a source and writes what it adds back to it: on the legacy trainer
the batch itself (:class:`LegacyBatch`); on the V1 trainer TransferQueue (:class:`TransferQueueBatch`),
read once before verl's ``_compute_advantage`` and written once after it (the rewards the estimator
used, where verl stores none, and the trace's row key). The V1 trainer's capture takes the batch verl
stores where verl computed it (:func:`v1_batch_advantaged`) rather than reading it back.

Where verl's own call chain passes between calls that verl-ext cannot give arguments to, a context
variable carries it, set once and taken once: the KL ``apply_kl_penalty`` computed (:func:`kl_applied`)
and the response mask before verl's rollout correction rejected tokens from it, with the numbers verl
logged of the correction (:func:`rollout_corrected`), to the step that captures them; the legacy step's
live metrics, to ``compute_data_metrics``; the V1 step, to the ``compute_advantage`` call inside verl's
``_compute_advantage`` (:class:`V1Call`).
A :class:`Run` holds what lasts one ``fit()``: its options and the trace writer.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from verl_ext import stopping
from verl_ext.integration import async_modes, estimate, metrics_hook, nonfinite_hook, trace_hook, truncation_hook, turn_rewards_hook
from verl_ext.integration.agent_turns import TURNS_KEY
from verl_ext.integration.stop_reasons import STOP_REASON_KEY
from verl_ext.options import (
    NONFINITE_DEFAULT,
    TRUNCATION_DEFAULT,
    TraceOptions,
    metrics_enabled,
    nonfinite_mode,
    turn_rewards_enabled,
)
from verl_ext.rollout_correction import Correction
from verl_ext.trace.batch_keys import ROW_KEY

# --------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class Run:
    """One ``fit()`` of a trainer, or (``trainer`` None) the calls of ``compute_advantage`` outside any."""

    trainer: Any = None
    kind: str = "legacy"  # or "v1"
    nonfinite: str = NONFINITE_DEFAULT
    metrics: bool = False  # outside fit() no logger would receive them
    turn_rewards: bool = False
    truncation: str = TRUNCATION_DEFAULT  # algorithm.truncation
    trace: TraceOptions = field(default_factory=TraceOptions)
    writer: Any = None  # the TraceWriter, while the run traces
    #: algorithm.rollout_correction (verl_ext.rollout_correction.Correction); None: none
    correction: Any = None
    #: how the trainer overlaps generation and training (the run record's mode: async_modes.run_mode)
    mode: Any = None

    def global_step(self) -> int | None:
        """verl's own step (``global_steps``), which ``verl_ext.trace.every`` selects."""
        return async_modes.traced_verl_step(self.trainer)

    def position(self) -> async_modes.UpdatePosition | None:
        """Where the update in progress sits: its trace step, verl's step and sub-step, the trainer's version."""
        return None if self.trainer is None else async_modes.position(self.trainer, self.kind, self.mode)

    def trace_step(self) -> int | None:
        """The trace's step of the update in progress: verl's step, except where one of verl's steps runs
        several updates (V1's parameter_sync_step > 1), each its own trace step (async_modes)."""
        place = self.position()
        return None if place is None else place.trace_step

    def traces_current_step(self) -> bool:
        return self.writer is not None and self.trace.traces_step(self.global_step())

    def fit_returned(self) -> None:
        """The trainer's ``fit()`` returned after its last step: the trace's run record says the run finished."""
        if self.writer is not None:
            self.writer.finish()


_OUTSIDE_FIT = Run()
#: The run whose fit() is in progress: the process's, whatever thread verl calls from.
_current: Run | None = None


def current_run() -> Run:
    return _current if _current is not None else _OUTSIDE_FIT


@contextlib.contextmanager
def fit_session(trainer: Any, kind: str) -> Iterator[Run]:
    """The run's options for the duration of ``fit()`` (``kind``: "legacy" or "v1"); its trace opened
    before the first step and flushed at the end, also when training fails."""
    config = trainer.config
    run = Run(
        trainer,
        kind,
        nonfinite=nonfinite_mode(config),
        metrics=metrics_enabled(config),
        turn_rewards=turn_rewards_enabled(config),
        truncation=truncation_hook.mode_of(config.get("algorithm")),
        trace=TraceOptions.from_config(config),
        correction=Correction.from_config((config.get("algorithm") or {}).get("rollout_correction")),
        mode=async_modes.run_mode(config, trainer, kind),
    )
    global _current
    with contextlib.ExitStack() as stack:
        if run.trace.enabled:
            run = dataclasses.replace(run, writer=stack.enter_context(trace_hook.open_trace(trainer, kind, run.trace, run.mode)))
        outer, _current = _current, run
        try:
            yield run
        finally:
            _current = outer


# --------------------------------------------------------------------------- the step's story


@dataclass(frozen=True)
class Estimated:
    """What one call of ``compute_advantage`` made of verl's batch (steps 1–4 of the module's story)."""

    #: the batch compute_advantage returns
    data: Any
    #: the step is traced
    traced: bool
    placed: turn_rewards_hook.PlacedTurnRewards | None
    #: the advantage before whitening: the estimator's, or returns − values of verl's GAE; None where
    #: there is none (verl's grpo, …)
    advantage_raw: Any
    #: what the estimate did at the cut responses (algorithm.truncation); None under terminal
    truncation: Any
    #: {"mean", "var"} the advantages were whitened with, over the tokens whitening used; None where not
    whitening: dict[str, float] | None
    #: the live metrics of the step ({} when they are off)
    metrics: dict[str, float]
    #: the first non-finite value's error, raised once the step is captured
    nonfinite: Exception | None
    #: what verl computed before the advantage step and handed over: the KL apply_kl_penalty applied,
    #: the response mask before its rollout correction rejected tokens (None: none at this step)
    kl: KlApplied | None = None
    corrected: OwnMask | None = None
    #: verl's training/rollout_probs_diff_… numbers of the step (calculate_debug_metrics), {} where none
    debug_logged: dict[str, float] = field(default_factory=dict)


def advantage(run: Run, source: LegacyBatch | TransferQueueBatch, arguments: dict[str, Any], verl_compute_advantage: Callable[[], Any]) -> Estimated:
    """One call of ``compute_advantage`` (``arguments``: the call's, by name; ``verl_compute_advantage()``
    runs verl's own), in the order of the module's story."""
    from verl_ext import registry

    data, traced, step = arguments["data"], run.traces_current_step(), run.trace_step()
    kl, corrected, debug = _handed_over(_KL_APPLIED, step), _handed_over(_OWN_MASK, step), _handed_over(_DEBUG_LOGGED, step)
    own = None if corrected is None else corrected.mask  # the turns are the policy's tokens', rejected ones included
    placed = turn_rewards_hook.place(data, *turn_rewards_hook.sources(data, source.extra_fields), own) if run.turn_rewards else None
    mode = truncation_hook.mode_of(arguments.get("config"))
    truncation = None if mode == TRUNCATION_DEFAULT else truncation_hook.truncation_of(data, mode, run.trainer, source.stored, own)
    name = registry.name_of(arguments["adv_estimator"])
    settings = (arguments["gamma"], arguments["lam"], arguments.get("config"))
    if name in registry.names():
        result = estimate.compute_registered_advantage(data, name, *settings, truncation=truncation)
        raw, whitening = result.advantage_raw, result.whitening
    else:
        if truncation is None:
            data = verl_compute_advantage()
        else:
            data = estimate.compute_verl_advantage_truncated(data, name, truncation, arguments, verl_compute_advantage)
        raw = estimate.verl_advantage_raw(data, name, *settings)
        # what verl whitened, over the full batch (the trace may keep part); only the trace records it
        whitening = registry.whitening_statistics(raw, data.batch["response_mask"], truncation) if traced else None
    metrics = {}
    if run.metrics:
        metrics = metrics_hook.live_metrics(data, arguments["gamma"], raw, None if corrected is None else corrected.mask, run.correction)
        metrics |= {} if placed is None else placed.metrics
        metrics |= _staleness(run, source, data)
    if step is None:  # outside fit(): the batch's step when it has one
        step = getattr(data, "meta_info", {}).get("global_steps")
    nonfinite = nonfinite_hook.check(data, run.nonfinite, None if step is None else int(step))
    return Estimated(data, traced, placed, raw, truncation, whitening, metrics, nonfinite, kl, corrected, {} if debug is None else debug.logged)


def _staleness(run: Run, source: LegacyBatch | TransferQueueBatch, data: Any) -> dict[str, float]:
    """The step's staleness as live metrics (``verl_ext/offpolicy/staleness_mean``, …; docs/definitions.md#staleness-how-old-the-trained-responses-are),
    in an asynchronous run only: a synchronous one's are 0 by construction, and its logger keeps the names it had."""
    from verl_ext.offpolicy_metrics import staleness_metrics
    from verl_ext.step_metrics import prefixed

    if (run.mode or {}).get("name", async_modes.SYNC) == async_modes.SYNC:
        return {}
    place, pairs = run.position(), source.versions(data)
    if place is None or not pairs:
        return {}
    return prefixed(staleness_metrics(place.trainer_version, [low for low, _ in pairs], [high for _, high in pairs]))


def captured(run: Run, estimated: Estimated, source: LegacyBatch | TransferQueueBatch) -> Any:
    """The trace's capture of a traced step (step 3 of the story), from the batch verl keeps."""
    tensors, uid, agent_turns, stop_reasons = source.captured(estimated.data)
    corrected, kl = estimated.corrected, estimated.kl
    rejected = None if corrected is None else corrected.mask.bool() & ~tensors["response_mask"].bool()
    placed = estimated.placed
    if placed is not None:  # V1 on grpo: verl estimates on a copy of the batch, which has them
        tensors["token_level_rewards"] = placed.rewards
    computed = {
        "advantage_raw": estimated.advantage_raw,
        "kl": None if kl is None else kl.kl,
        "turn_score": None if placed is None else placed.turn_score,
        "tool_reward": None if placed is None else placed.tool_reward,
    }
    kl_coef = None if kl is None else kl.beta
    logged = {
        **({} if corrected is None else corrected.logged), **estimated.debug_logged, **async_modes.logged_counts(run.trainer, run.mode),
    }  # fmt: skip
    return trace_hook.step_capture(
        run.trainer, tensors, uid, computed, kl_coef, agent_turns, estimated.truncation, stop_reasons, estimated.whitening,
        rejected, logged, run.position(), source.versions(estimated.data),
    )  # fmt: skip


def written(run: Run, estimated: Estimated, source: LegacyBatch | TransferQueueBatch) -> Any:
    """What the step adds to verl's batch: the trace's row key on a traced step (which asks the
    workers for their update reports), and the rewards the estimator used where verl keeps none.
    Returns what the trainer goes on with (the source's ``write``)."""
    fields = {}
    if estimated.traced and run.trace.update:
        fields[ROW_KEY] = trace_hook.rows(source.batch_size(estimated.data), run.trace.max_samples_per_step)
    if estimated.placed is not None and run.trainer is not None and not run.trainer.config.algorithm.use_kl_in_reward:
        fields["token_level_rewards"] = estimated.placed.rewards
    return source.write(estimated.data, fields)


def _finish(run: Run, estimated: Estimated, source: LegacyBatch | TransferQueueBatch) -> Any:
    """Capture and write a step: what both trainers do once the advantages are in verl's batch.
    Returns what the trainer goes on with; a non-finite value raises once the step is kept."""
    _KL_APPLIED.set(None)  # taken: a later step without KL in the reward or a correction must not see them
    _OWN_MASK.set(None)
    _DEBUG_LOGGED.set(None)
    if estimated.traced and estimated.data is not None:
        run.writer.submit(captured(run, estimated, source))
    going_on = written(run, estimated, source)
    if estimated.nonfinite is not None:
        raise estimated.nonfinite
    return going_on


# --------------------------------------------------------------------------- the trainers' calls


def advantage_step(arguments: dict[str, Any], verl_compute_advantage: Callable[[], Any]) -> Any:
    """verl's ``compute_advantage`` with verl-ext. Returns the batch with its advantages. A run asked to
    stop (Ctrl-C, SIGTERM: :mod:`verl_ext.stopping`) stops here, before the step records anything."""
    call = _V1_CALL.get()
    if call is not None:  # called inside the V1 trainer's _compute_advantage: part of its step
        call.estimated = advantage(call.run, call.source, arguments, verl_compute_advantage)
        return call.estimated.data
    run = current_run()
    if run.trainer is not None:
        stopping.raise_if_requested(run.global_step())
    source = LegacyBatch()
    estimated = advantage(run, source, arguments, verl_compute_advantage)
    _LEGACY_METRICS.set(estimated.metrics)  # for compute_data_metrics, later in the same fit() step
    return _finish(run, estimated, source)


@dataclass
class V1Call:
    """The V1 trainer's step while verl's ``_compute_advantage`` runs: the ``compute_advantage`` call
    inside it leaves its result here."""

    run: Run
    source: TransferQueueBatch
    estimated: Estimated | None = None


_V1_CALL: contextvars.ContextVar[V1Call | None] = contextvars.ContextVar("verl_ext_v1_call", default=None)


def v1_advantage_step(batch_meta: Any, metrics: dict, verl_step: Callable[[], Any]) -> Any:
    """The V1 trainer's ``_compute_advantage`` with verl-ext; ``verl_step()`` runs verl's own, which
    calls ``compute_advantage`` (:func:`advantage_step`) on the batch it reads. Returns the batch meta
    the updates use; the step's live metrics go into ``metrics``, the step's metrics in V1."""
    run = current_run()
    stopping.raise_if_requested(run.global_step())
    source = TransferQueueBatch(batch_meta)
    source.read(_v1_fields(run, source.meta))
    call = V1Call(run, source)
    token = _V1_CALL.set(call)
    try:
        source.meta = verl_step()
    finally:
        _V1_CALL.reset(token)
    if call.estimated is None:  # verl's step computed no advantage: nothing of verl-ext's to add
        return source.meta
    metrics.update(call.estimated.metrics)
    return _finish(run, call.estimated, source)


def _v1_fields(run: Run, meta: Any) -> list[str]:
    """What the V1 step needs and verl's batch at its advantage step lacks, read at once (``meta``:
    the batch meta, whose ``fields`` are what TransferQueue holds, None: unknown)."""
    traced = run.traces_current_step()
    if not (run.turn_rewards or traced or run.truncation != TRUNCATION_DEFAULT):
        return []
    fields = meta.fields
    with_extra_fields = fields is not None and "extra_fields" in fields
    wanted = []
    if run.turn_rewards and with_extra_fields:
        wanted += ["extra_fields", "response_mask"]  # the mask's lengths, to store the rewards placed
    if traced:
        wanted += [name for name in trace_hook.V1_TOKEN_FIELDS if fields is None or name in fields]
        wanted += ["extra_fields"] if with_extra_fields else []
    wanted += truncation_hook.v1_fields(run.truncation, fields)  # the cut's token ids, V(s_L)
    return list(dict.fromkeys(wanted))


def v1_batch_advantaged(data: Any) -> None:
    """The V1 trainer's batch once ``compute_advantage_for_multi_trajectories`` has put the advantages
    on all its rows (on grpo, ``compute_advantage`` sees only each session's last output)."""
    call = _V1_CALL.get()
    if call is not None:
        call.source.advantaged = data


# --------------------------------------------------------------------------- calls from verl outside the advantage step


@dataclass(frozen=True)
class KlApplied:
    """kld_t (B, T) as ``apply_kl_penalty`` computed it (on the valid tokens) and the β it applied, at ``step``."""

    step: int | None
    kl: Any
    beta: float


_KL_APPLIED: contextvars.ContextVar[KlApplied | None] = contextvars.ContextVar("verl_ext_kl_applied", default=None)
#: The values verl's ``core_algos.kl_penalty`` returned while ``apply_kl_penalty`` runs (else None).
_KL_SEEN: contextvars.ContextVar[list | None] = contextvars.ContextVar("verl_ext_kl_seen", default=None)


@contextlib.contextmanager
def kl_applied(data: Any, beta: float) -> Iterator[None]:
    """Around verl's ``apply_kl_penalty`` on ``data`` (β read before its controller updates): the kld_t
    verl's ``kl_penalty`` returns inside it, kept for the step's capture when the step is traced."""
    run = current_run()
    if not run.traces_current_step():
        yield
        return
    seen: list = []
    token = _KL_SEEN.set(seen)
    try:
        yield
    finally:
        _KL_SEEN.reset(token)
    if seen:
        _KL_APPLIED.set(KlApplied(run.trace_step(), seen[-1] * data.batch["response_mask"], float(beta)))


def kl_penalty_returned(kld: Any) -> None:
    """verl's ``core_algos.kl_penalty`` returned ``kld``: kept when ``apply_kl_penalty`` asked (:func:`kl_applied`)."""
    seen = _KL_SEEN.get()
    if seen is not None:
        seen.append(kld)


@dataclass(frozen=True)
class OwnMask:
    """The response mask of ``step`` before verl's rollout correction rejected tokens from it, and the
    numbers verl logged of the correction (``rollout_corr/…``)."""

    step: int | None
    mask: Any
    logged: dict[str, float]


_OWN_MASK: contextvars.ContextVar[OwnMask | None] = contextvars.ContextVar("verl_ext_own_mask", default=None)


def rollout_corrected(batch: Any, correct: Callable[[], Any]) -> Any:
    """verl's ``compute_rollout_correction_and_add_to_batch`` on ``batch`` (``correct()``), which replaces
    its response mask with the one left after rejection: the mask before is kept for the step (the tokens
    the policy wrote: the rejected ones are not holes), for its capture and its live metrics' turns."""
    own = batch.batch["response_mask"]  # verl assigns a new tensor to the key: this one stays as it is
    corrected, metrics = correct()
    logged = {key: float(value) for key, value in metrics.items() if isinstance(value, (int, float))}
    _OWN_MASK.set(OwnMask(current_run().trace_step(), own, logged))
    return corrected, metrics


@dataclass(frozen=True)
class DebugLogged:
    """The numbers verl's ``calculate_debug_metrics`` logged of ``step`` (``training/rollout_probs_diff_…``)."""

    step: int | None
    logged: dict[str, float]


_DEBUG_LOGGED: contextvars.ContextVar[DebugLogged | None] = contextvars.ContextVar("verl_ext_debug_logged", default=None)


def debug_metrics_computed(metrics: dict) -> None:
    """verl's ``calculate_debug_metrics`` returned ``metrics`` for the step under way (inside ``fit()``), before
    its advantage step: kept for the step's capture, which holds them to the trace (``verl-ext check``)."""
    from verl_ext.offpolicy_metrics import PROBS_DIFF_PREFIX

    if _current is None:
        return
    logged = {key: float(value) for key, value in metrics.items() if key.startswith(PROBS_DIFF_PREFIX) and isinstance(value, (int, float))}
    _DEBUG_LOGGED.set(DebugLogged(current_run().trace_step(), logged))


def _handed_over(variable: contextvars.ContextVar, step: int | None) -> Any:
    """What ``variable`` holds for ``step`` (the step's own advantage call clears it once it is done)."""
    held = variable.get()
    return held if held is not None and held.step == step else None


#: The legacy step's live metrics, from its compute_advantage to its compute_data_metrics.
_LEGACY_METRICS: contextvars.ContextVar[dict[str, float]] = contextvars.ContextVar("verl_ext_legacy_metrics", default={})


def take_metrics() -> dict[str, float]:
    """The legacy trainer's step metrics are a local of its ``fit()``: they take the live metrics
    through the dict ``compute_data_metrics`` returns there (in ``RayPPOTrainer.fit``), once per step."""
    metrics = _LEGACY_METRICS.get()
    _LEGACY_METRICS.set({})
    return metrics


def reduce_update_metrics(metrics: dict, reduce: Callable[[], dict]) -> dict:
    """verl's reduction of an update's metrics (``reduce()``), with the workers' per-token reports in
    them taken out first (verl would average them as numbers) and handed to the run's trace."""
    reports = trace_hook.take_update_reports(metrics)
    reduced = reduce()
    run = current_run()
    if reports and run.writer is not None:
        trace_hook.submit_updates(run.writer, run.trace_step(), reports, reduced)
    return reduced


# --------------------------------------------------------------------------- where a step's batch lives


class LegacyBatch:
    """The legacy trainer's step: the batch ``compute_advantage`` receives and returns is all of it."""

    extra_fields = None
    stored: dict[str, Any] = {}

    def captured(self, data: Any) -> tuple[Any, Any, Any, Any]:
        """(tensors, uid, agent turns, stop reasons) of the step, as :func:`trace_hook.step_capture` takes them."""
        extra = data.non_tensor_batch
        return data.batch, extra.get("uid"), extra.get(TURNS_KEY), extra.get(STOP_REASON_KEY)

    def batch_size(self, data: Any) -> int:
        return len(data.batch["response_mask"])

    def versions(self, data: Any) -> list | None:
        """(min, max) policy version per response, as the agent loop tagged them (async_modes.legacy_versions)."""
        return async_modes.legacy_versions(data.non_tensor_batch)

    def write(self, data: Any, fields: dict[str, Any]) -> Any:
        """The row key onto the batch, which the trainer goes on with (the rewards are on it already)."""
        if ROW_KEY in fields:
            data.batch[ROW_KEY] = fields[ROW_KEY]
        return data


class TransferQueueBatch:
    """The V1 trainer's step: its batch lives in TransferQueue, read once before verl's
    ``_compute_advantage`` and written once after it; verl's batch at the advantage step lacks the
    agent loop's ``extra_fields``, the token ids, the prompts and V(s_L)."""

    def __init__(self, meta: Any):
        #: the batch meta: verl's on the way in, the one verl's step returns once it has run
        self.meta = meta
        #: the samples' TransferQueue tags on the way in (their policy versions)
        self.tags = getattr(meta, "tags", None)
        #: the samples' extra_fields (the agent loop's), when read
        self.extra_fields: list | None = None
        #: the other fields read, by name
        self.stored: dict[str, Any] = {}
        #: the whole batch with its advantages, as verl stores it (:func:`v1_batch_advantaged`)
        self.advantaged: Any = None

    def read(self, wanted: list[str]) -> None:
        if not wanted:
            return
        import transfer_queue as tq

        stored = tq.kv_batch_get(keys=self.meta.keys, partition_id=self.meta.partition_id, select_fields=wanted)
        if "extra_fields" in wanted:
            self.extra_fields = stored.pop("extra_fields").tolist()
        self.stored = {name: stored[name] for name in wanted if name != "extra_fields"}

    def captured(self, data: Any) -> tuple[Any, Any, Any, Any]:
        """As :meth:`LegacyBatch.captured`, from the batch verl stores, with the fields read."""
        data = self.advantaged if self.advantaged is not None else data
        extra_fields = self.extra_fields

        def per_sample(key: str) -> list | None:
            return None if extra_fields is None else [e.get(key) if isinstance(e, dict) else None for e in extra_fields]

        uid = data.non_tensor_batch.get("uid")
        return trace_hook.v1_tensors(data, self.stored), uid, per_sample(TURNS_KEY), per_sample(STOP_REASON_KEY)

    def batch_size(self, data: Any) -> int:
        return len(self.meta.keys)

    def versions(self, data: Any) -> list | None:
        """(min, max) policy version per sample, from its TransferQueue tags (async_modes.v1_versions)."""
        return async_modes.v1_versions(self.tags)

    def write(self, data: Any, fields: dict[str, Any]) -> Any:
        """The fields into TransferQueue; the rewards only where their lengths were read (verl stores
        rewards only with KL in the reward). Returns the batch meta the updates use."""
        if "response_mask" in self.stored and "token_level_rewards" in fields:
            from verl.workers.utils.padding import response_to_nested

            fields["token_level_rewards"] = response_to_nested(fields["token_level_rewards"], self.stored["response_mask"])
        else:
            fields.pop("token_level_rewards", None)
        if not fields:
            return self.meta
        import transfer_queue as tq
        from tensordict import TensorDict

        rows = TensorDict(fields, batch_size=len(self.meta.keys))
        return tq.kv_batch_put(keys=self.meta.keys, partition_id=self.meta.partition_id, fields=rows)

"""One training step of verl-ext: what it does at verl's advantage step, in order, on both trainers.

verl's trainers reach verl-ext at their advantage step: the legacy trainer calls ``compute_advantage``;
the V1 trainer calls its ``_compute_advantage``, which reads the batch from TransferQueue, calls
``compute_advantage`` and stores the results. :mod:`verl_ext.integration.patches` hands both here. A
step is this story, one :class:`Step` object per training step:

1. place the per-turn rewards on the token rewards (``verl_ext.turn_rewards``), before any estimator;
2. estimate: verl-ext's estimator with the critic's values, or verl's own; the responses cut at the
   length limit treated as ``algorithm.truncation`` says;
3. capture the step into the trace (``verl_ext.trace``; on V1 once verl has stored it);
4. compute the live metrics (``verl_ext.step_metrics``; the option ``verl_ext.metrics`` turns them off), held until
   the trainer takes them;
5. check for non-finite values (``verl_ext.nonfinite``).

The step reads verl's batch from a source and writes what it adds back to it: on the legacy trainer
the batch itself (:class:`LegacyBatch`); on the V1 trainer TransferQueue (:class:`TransferQueueBatch`),
read once before verl's ``_compute_advantage`` and written once after it (the rewards the estimator
used, where verl stores none, and the trace's row key). The V1 trainer's capture takes the batch verl
stores where verl computed it (:func:`v1_batch_advantaged`) rather than reading it back. Non-finite
values raise once the step is captured and written, so that a traced step is kept.

A :class:`Run` holds what lasts one ``fit()`` (the options, the trace writer) and what passes between
the calls of one step (the KL recorded before the estimate, the metrics until the trainer takes them).
Everything returns at once when its option is off.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from verl_ext import stopping
from verl_ext.integration import estimate, metrics_hook, nonfinite_hook, trace_hook, truncation_hook, turn_rewards_hook
from verl_ext.integration.agent_turns import TURNS_KEY
from verl_ext.integration.stop_reasons import STOP_REASON_KEY
from verl_ext.trace.batch_keys import ROW_KEY
from verl_ext.options import (
    NONFINITE_DEFAULT,
    TRUNCATION_DEFAULT,
    TraceOptions,
    metrics_enabled,
    nonfinite_mode,
    turn_rewards_enabled,
)

# --------------------------------------------------------------------------- the step's story


def advantage_step(arguments: dict[str, Any], verl_compute_advantage: Callable[[], Any]) -> Any:
    """verl's ``compute_advantage`` with verl-ext. ``arguments``: the call's, by name;
    ``verl_compute_advantage()`` runs verl's own. Returns the batch with its advantages. A run asked to
    stop (Ctrl-C, SIGTERM: :mod:`verl_ext.stopping`) stops here, before the step records anything."""
    if _v1_step is not None:  # called inside the V1 trainer's _compute_advantage: part of its step
        _v1_step.advantage(arguments, verl_compute_advantage)
        return _v1_step.data
    run = current_run()
    if run.trainer is not None:
        stopping.raise_if_requested(int(run.trainer.global_steps))
    step = Step(run, LegacyBatch())
    step.advantage(arguments, verl_compute_advantage)
    step.capture()
    step.write()
    step.raise_if_nonfinite()
    return step.data


def v1_advantage_step(batch_meta: Any, metrics: dict, verl_step: Callable[[], Any]) -> Any:
    """The V1 trainer's ``_compute_advantage`` with verl-ext; ``verl_step()`` runs verl's own, which
    calls ``compute_advantage`` (:func:`advantage_step`) on the batch it reads. Returns the batch meta
    the updates use."""
    global _v1_step
    run = current_run()
    stopping.raise_if_requested(int(run.trainer.global_steps))
    step = Step(run, TransferQueueBatch(batch_meta))
    step.read()
    outer, _v1_step = _v1_step, step
    try:
        step.source.meta = verl_step()
    finally:
        _v1_step = outer
    step.capture()
    metrics.update(run.take_metrics())  # V1 hands this method its step's metrics
    batch_meta = step.write()
    step.raise_if_nonfinite()  # once stored and captured
    return batch_meta


def v1_batch_advantaged(data: Any) -> None:
    """The V1 trainer's batch once ``compute_advantage_for_multi_trajectories`` has put the advantages
    on all its rows (on grpo, ``compute_advantage`` sees only each session's last output)."""
    if _v1_step is not None:
        _v1_step.source.advantaged = data


#: The V1 trainer's step while verl's ``_compute_advantage`` runs, which the calls inside it join.
_v1_step: Step | None = None


# --------------------------------------------------------------------------- the run


@dataclass
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
    #: apply_kl_penalty's kld_t and β of a traced step, until its capture
    kl: dict[str, Any] = field(default_factory=dict)
    #: the live metrics of the last step, until the trainer takes them
    held_metrics: dict[str, float] = field(default_factory=dict)

    def traces_current_step(self) -> bool:
        return self.writer is not None and self.trace.traces_step(int(self.trainer.global_steps))

    def fit_returned(self) -> None:
        """The trainer's ``fit()`` returned after its last step: the trace's run record says the run finished."""
        if self.writer is not None:
            self.writer.finish()

    def take_kl(self) -> dict[str, Any]:
        kl, self.kl = self.kl, {}
        return kl

    def take_metrics(self) -> dict[str, float]:
        """The metrics of the step whose advantages were computed last, once (then {})."""
        held, self.held_metrics = self.held_metrics, {}
        return held


_OUTSIDE_FIT = Run()
_current: Run | None = None


def current_run() -> Run:
    return _current if _current is not None else _OUTSIDE_FIT


@contextlib.contextmanager
def fit_session(trainer: Any, kind: str) -> Iterator[Run]:
    """The run's options for the duration of ``fit()`` (``kind``: "legacy" or "v1"); its trace opened
    before the first step and flushed at the end, also when training fails."""
    global _current
    config = trainer.config
    run = Run(
        trainer,
        kind,
        nonfinite=nonfinite_mode(config),
        metrics=metrics_enabled(config),
        turn_rewards=turn_rewards_enabled(config),
        truncation=truncation_hook.mode_of(config.get("algorithm")),
        trace=TraceOptions.from_config(config),
    )
    outer, _current = _current, run
    try:
        if not run.trace.enabled:
            yield run
            return
        with trace_hook.open_trace(trainer, kind, run.trace) as run.writer:
            yield run
    finally:
        _current = outer


# --------------------------------------------------------------------------- one step


class Step:
    """One step's advantage computation on either trainer: verl's batch, read from and written to its
    ``source`` (:class:`LegacyBatch` or :class:`TransferQueueBatch`), and what verl-ext adds to it."""

    def __init__(self, run: Run, source: LegacyBatch | TransferQueueBatch):
        self.run = run
        self.source = source
        self.traced = run.traces_current_step()
        self.arguments: dict[str, Any] = {}
        #: the batch compute_advantage returns
        self.data: Any = None
        self.placed: turn_rewards_hook.PlacedTurnRewards | None = None
        #: the advantage before whitening: the estimator's, or returns − values of verl's GAE; None
        #: where there is none (verl's grpo, …)
        self.advantage_raw: Any = None
        #: what the estimate did at the cut responses (algorithm.truncation); None under terminal
        self.truncation: Any = None
        #: {"mean", "var"} of advantage_raw over the tokens whitening uses (registry.whitening_statistics)
        self.whitening: dict[str, float] | None = None
        #: the first non-finite value's error, raised once the step is captured
        self.nonfinite: Exception | None = None

    def read(self) -> None:
        """What the step needs and verl's batch at its advantage step lacks, in one read (V1 only)."""
        run = self.run
        if not (run.turn_rewards or self.traced or run.truncation != TRUNCATION_DEFAULT):
            return
        fields = self.source.meta.fields
        with_extra_fields = fields is not None and "extra_fields" in fields
        wanted = []
        if run.turn_rewards and with_extra_fields:
            wanted += ["extra_fields", "response_mask"]  # the mask's lengths, to store the rewards placed
        if self.traced:
            wanted += [name for name in trace_hook.V1_TOKEN_FIELDS if fields is None or name in fields]
            wanted += ["extra_fields"] if with_extra_fields else []
        wanted += truncation_hook.v1_fields(run.truncation, fields)  # the cut's token ids, V(s_L)
        self.source.read(list(dict.fromkeys(wanted)))

    def advantage(self, arguments: dict[str, Any], verl_compute_advantage: Callable[[], Any]) -> None:
        """One call of ``compute_advantage``, in the order of the module's story (steps 1, 2, 4, 5)."""
        self.arguments, self.data = arguments, arguments["data"]
        self.place_turn_rewards()
        self.estimate(verl_compute_advantage)
        self.compute_metrics()
        self.check_nonfinite()

    def place_turn_rewards(self) -> None:
        if self.run.turn_rewards:
            self.placed = turn_rewards_hook.place(self.data, *turn_rewards_hook.sources(self.data, self.source.extra_fields))

    def estimate(self, verl_compute_advantage: Callable[[], Any]) -> None:
        from verl_ext import registry

        arguments = self.arguments
        name = registry.name_of(arguments["adv_estimator"])
        settings = (arguments["gamma"], arguments["lam"], arguments.get("config"))
        self.truncation = self.cut_responses()
        if name in registry.names():
            result = estimate.compute_registered_advantage(self.data, name, *settings, truncation=self.truncation)
            self.advantage_raw = result.advantage_raw
        else:
            if self.truncation is None:
                self.data = verl_compute_advantage()
            else:
                self.data = estimate.compute_verl_advantage_truncated(self.data, name, self.truncation, arguments, verl_compute_advantage)
            self.advantage_raw = estimate.verl_advantage_raw(self.data, name, *settings)
        if self.traced:  # what the trace records of the whitening, over the full batch (the trace may keep part)
            self.whitening = registry.whitening_statistics(self.advantage_raw, self.data.batch["response_mask"], self.truncation)

    def cut_responses(self) -> Any:
        """The step's :class:`verl_ext.truncation.Truncation` under the call's ``algorithm.truncation``;
        None under terminal, where nothing is read or computed."""
        mode = truncation_hook.mode_of(self.arguments.get("config"))
        if mode == TRUNCATION_DEFAULT:
            return None
        return truncation_hook.truncation_of(self.data, mode, self.run.trainer, self.source.stored)

    def compute_metrics(self) -> None:
        if self.run.metrics:
            metrics = metrics_hook.live_metrics(self.data, self.arguments["gamma"], self.advantage_raw)
            self.run.held_metrics = metrics | ({} if self.placed is None else self.placed.metrics)

    def check_nonfinite(self) -> None:
        if self.nonfinite is None:
            self.nonfinite = nonfinite_hook.check(self.data, self.run.nonfinite, self.global_step())

    def capture(self) -> None:
        """The step into the trace (step 3 of the module's story), from the batch verl keeps."""
        if not self.traced or self.data is None:
            return
        tensors, uid, agent_turns, stop_reasons = self.source.captured(self.data)
        if self.placed is not None:  # V1 on grpo: verl estimates on a copy of the batch, which has them
            tensors["token_level_rewards"] = self.placed.rewards
        kl, placed = self.run.take_kl(), self.placed
        computed = {
            "advantage_raw": self.advantage_raw,
            "kl": kl.get("kl"),
            "turn_score": None if placed is None else placed.turn_score,
            "tool_reward": None if placed is None else placed.tool_reward,
        }
        trace_hook.submit_step(
            self.run.writer,
            self.run.trainer,
            tensors,
            uid,
            computed,
            kl.get("kl_coef"),
            agent_turns,
            self.truncation,
            stop_reasons,
            self.whitening,
        )

    def write(self) -> Any:
        """What the step adds to verl's batch: the trace's row key on a traced step (which asks the
        workers for their update reports), and the rewards the estimator used where verl keeps none.
        Returns what the trainer goes on with (the source's :meth:`write`)."""
        run, fields = self.run, {}
        if self.traced and run.trace.update:
            fields[ROW_KEY] = trace_hook.rows(self.source.batch_size(self.data), run.trace.max_samples_per_step)
        if self.placed is not None and run.trainer is not None and not run.trainer.config.algorithm.use_kl_in_reward:
            fields["token_level_rewards"] = self.placed.rewards
        return self.source.write(self.data, fields)

    def raise_if_nonfinite(self) -> None:
        if self.nonfinite is not None:
            raise self.nonfinite

    def global_step(self) -> int | None:
        """The trainer's step; outside fit() the batch's ``meta_info["global_steps"]`` when it has it."""
        steps = getattr(self.run.trainer, "global_steps", None)
        if steps is None:
            steps = getattr(self.data, "meta_info", {}).get("global_steps")
        return None if steps is None else int(steps)


# --------------------------------------------------------------------------- where a step's batch lives


class LegacyBatch:
    """The legacy trainer's step: the batch ``compute_advantage`` receives and returns is all of it."""

    extra_fields = None
    stored: dict[str, Any] = {}

    def read(self, wanted: list[str]) -> None:
        pass  # nothing lives elsewhere

    def captured(self, data: Any) -> tuple[Any, Any, Any, Any]:
        """(tensors, uid, agent turns, stop reasons) of the step, as :func:`trace_hook.submit_step` takes them."""
        extra = data.non_tensor_batch
        return data.batch, extra.get("uid"), extra.get(TURNS_KEY), extra.get(STOP_REASON_KEY)

    def batch_size(self, data: Any) -> int:
        return len(data.batch["response_mask"])

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

# --------------------------------------------------------------------------- calls from verl outside the advantage step


def record_kl(data: Any, beta: float, kl_penalty: str) -> None:
    """``apply_kl_penalty``'s kld_t and β (read before its controller updates), for a traced step's capture."""
    run = current_run()
    if run.traces_current_step():
        run.kl = {"kl": trace_hook.kl_of(data, kl_penalty), "kl_coef": float(beta)}


def take_metrics() -> dict[str, float]:
    """The legacy trainer's step metrics are a local of its ``fit()``: they take the live metrics
    through the dict ``compute_data_metrics`` returns there (in ``RayPPOTrainer.fit``), once per step."""
    return current_run().take_metrics()


def reduce_update_metrics(metrics: dict, reduce: Callable[[], dict]) -> dict:
    """verl's reduction of an update's metrics (``reduce()``), with the workers' per-token reports in
    them taken out first (verl would average them as numbers) and handed to the run's trace."""
    reports = trace_hook.take_update_reports(metrics)
    reduced = reduce()
    run = current_run()
    if reports and run.writer is not None:
        trace_hook.submit_updates(run.writer, int(run.trainer.global_steps), reports, reduced)
    return reduced

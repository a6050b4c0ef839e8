"""One training step of verl-ext: what it does at verl's advantage step, in order, on both trainers.

verl's trainers reach verl-ext at their advantage step: the legacy trainer calls ``compute_advantage``;
the V1 trainer calls its ``_compute_advantage``, which reads the batch from TransferQueue, calls
``compute_advantage`` and stores the results. :mod:`verl_ext.integration.patches` hands both here. A
step is this story (:func:`advantage_step`), one :class:`AdvantageStep` object per call:

1. place the per-turn rewards on the token rewards (``verl_ext.turn_rewards``), before any estimator;
2. estimate: verl-ext's estimator with the critic's values, or verl's own; the responses cut at the
   length limit treated as ``algorithm.truncation`` says;
3. capture the step into the trace (``verl_ext.trace``; on V1 once verl has stored it);
4. compute the live metrics (``verl_ext.step_metrics``; the option ``verl_ext.metrics`` turns them off), held until
   the trainer takes them;
5. check for non-finite values (``verl_ext.nonfinite``), after the capture, so that a traced step is
   kept when the check raises.

On the V1 trainer (:func:`v1_advantage_step`, one :class:`V1Step`) TransferQueue is read once, before
verl's ``_compute_advantage`` (what its batch there lacks: the agent loop's ``extra_fields``, the token
ids, the prompts and V(s_L)), and written once after it (the rewards the estimator used, where verl stores
none, and the trace's row key). The batch the trace captures is the one verl stores, taken where verl
computed it (:func:`v1_batch_advantaged`) rather than read back.

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
    run = current_run()
    if run.trainer is not None:
        stopping.raise_if_requested(int(run.trainer.global_steps))
    step = run.begin_step(arguments)
    step.place_turn_rewards()
    step.estimate(verl_compute_advantage)
    step.capture()
    step.compute_metrics()
    step.check_nonfinite()
    return step.data


def v1_advantage_step(batch_meta: Any, metrics: dict, verl_step: Callable[[], Any]) -> Any:
    """The V1 trainer's ``_compute_advantage`` with verl-ext; ``verl_step()`` runs verl's own, which
    calls ``compute_advantage`` (:func:`advantage_step`) on the batch it reads. Returns the batch meta
    the updates use."""
    run = current_run()
    stopping.raise_if_requested(int(run.trainer.global_steps))
    step = V1Step(run, batch_meta)
    step.read_transfer_queue()
    with step.in_progress():  # a non-finite step raises at the end, once stored and captured
        batch_meta = verl_step()
        step.capture()
        metrics.update(step.run.take_metrics())  # V1 hands this method its step's metrics
        batch_meta = step.write_transfer_queue(batch_meta)
    return batch_meta


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
    #: the V1 trainer's step in progress
    v1: V1Step | None = None

    def traces_current_step(self) -> bool:
        return self.writer is not None and self.trace.traces_step(int(self.trainer.global_steps))

    def begin_step(self, arguments: dict[str, Any]) -> AdvantageStep:
        step = AdvantageStep(self, arguments)
        if self.v1 is not None:
            self.v1.advantage_step = step  # the V1 step stores and captures it after verl's own step
        return step

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


# --------------------------------------------------------------------------- one call of compute_advantage


class AdvantageStep:
    """One call of verl's ``compute_advantage``: verl's batch and what verl-ext adds to it."""

    def __init__(self, run: Run, arguments: dict[str, Any]):
        self.run = run
        self.arguments = arguments
        self.data = arguments["data"]
        self.placed: turn_rewards_hook.PlacedTurnRewards | None = None
        #: the advantage before whitening: the estimator's, or returns − values of verl's GAE; None
        #: where there is none (verl's grpo, …)
        self.advantage_raw: Any = None
        #: what the estimate did at the cut responses (algorithm.truncation); None under terminal
        self.truncation: Any = None

    def place_turn_rewards(self) -> None:
        if not self.run.turn_rewards:
            return
        extra_fields = None if self.run.v1 is None else self.run.v1.extra_fields
        self.placed = turn_rewards_hook.place(self.data, *turn_rewards_hook.sources(self.data, extra_fields))

    def estimate(self, verl_compute_advantage: Callable[[], Any]) -> None:
        from verl_ext import registry

        arguments = self.arguments
        name = registry.name_of(arguments["adv_estimator"])
        settings = (arguments["gamma"], arguments["lam"], arguments.get("config"))
        self.truncation = self.cut_responses()
        if name in registry.names():
            result = estimate.compute_registered_advantage(self.data, name, *settings, truncation=self.truncation)
            self.advantage_raw = result.advantage_raw
            return
        if self.truncation is None:
            self.data = verl_compute_advantage()
        else:
            self.data = estimate.compute_verl_advantage_truncated(self.data, name, self.truncation, arguments, verl_compute_advantage)
        self.advantage_raw = estimate.verl_advantage_raw(self.data, name, *settings)

    def cut_responses(self) -> Any:
        """The step's :class:`verl_ext.truncation.Truncation` under the call's ``algorithm.truncation``;
        None under terminal, where nothing is read or computed."""
        mode = truncation_hook.mode_of(self.arguments.get("config"))
        if mode == TRUNCATION_DEFAULT:
            return None
        stored = {} if self.run.v1 is None else self.run.v1.stored
        return truncation_hook.truncation_of(self.data, mode, self.run.trainer, stored)

    def capture(self) -> None:
        """The legacy trainer's step, into the trace (V1: :meth:`V1Step.capture`)."""
        run = self.run
        if run.v1 is not None or not run.traces_current_step():
            return
        data = self.data
        extra = data.non_tensor_batch
        self.submit_to_trace(data.batch, extra.get("uid"), extra.get(TURNS_KEY), extra.get(STOP_REASON_KEY))
        if run.trace.update:
            from verl_ext.integration.update_hook import ROW_KEY

            data.batch[ROW_KEY] = trace_hook.rows(len(data.batch["response_mask"]), run.trace.max_samples_per_step)

    def submit_to_trace(self, batch: Any, uid: Any, agent_turns: Any, stop_reasons: Any = None) -> None:
        kl, placed = self.run.take_kl(), self.placed
        computed = {
            "advantage_raw": self.advantage_raw,
            "kl": kl.get("kl"),
            "turn_score": None if placed is None else placed.turn_score,
            "tool_reward": None if placed is None else placed.tool_reward,
        }
        trace_hook.submit_step(
            self.run.writer, self.run.trainer, batch, uid, computed, kl.get("kl_coef"), agent_turns, self.truncation, stop_reasons
        )

    def compute_metrics(self) -> None:
        if not self.run.metrics:
            return
        metrics = metrics_hook.live_metrics(self.data, self.arguments["gamma"], self.advantage_raw)
        self.run.held_metrics = metrics | ({} if self.placed is None else self.placed.metrics)

    def check_nonfinite(self) -> None:
        error = nonfinite_hook.check(self.data, self.run.nonfinite, self.global_step())
        if error is None:
            return
        if self.run.v1 is not None:
            self.run.v1.hold(error)
        else:
            raise error

    def global_step(self) -> int | None:
        """The trainer's step; outside fit() the batch's ``meta_info["global_steps"]`` when it has it."""
        steps = getattr(self.run.trainer, "global_steps", None)
        if steps is None:
            steps = getattr(self.data, "meta_info", {}).get("global_steps")
        return None if steps is None else int(steps)


# --------------------------------------------------------------------------- one call of V1's _compute_advantage


class V1Step:
    """One call of the V1 trainer's ``_compute_advantage``: its batch lives in TransferQueue."""

    def __init__(self, run: Run, batch_meta: Any):
        self.run = run
        self.batch_meta = batch_meta
        self.traced = run.traces_current_step()
        #: the samples' extra_fields (the agent loop's), when read
        self.extra_fields: list | None = None
        #: the other fields read from TransferQueue, by name
        self.stored: dict[str, Any] = {}
        #: the compute_advantage call made inside verl's step
        self.advantage_step: AdvantageStep | None = None
        #: the whole batch with its advantages, as verl stores it (v1_batch_advantaged)
        self.batch: Any = None
        self.held_error: Exception | None = None

    def read_transfer_queue(self) -> None:
        """The one read: what the step needs and verl's batch at its advantage step lacks."""
        if not (self.run.turn_rewards or self.traced or self.run.truncation != TRUNCATION_DEFAULT):
            return
        fields = self.batch_meta.fields
        with_extra_fields = fields is not None and "extra_fields" in fields
        wanted = []
        if self.run.turn_rewards and with_extra_fields:
            wanted += ["extra_fields", "response_mask"]  # the mask's lengths, to store the rewards placed
        if self.traced:
            wanted += [name for name in trace_hook.V1_TOKEN_FIELDS if fields is None or name in fields]
            wanted += ["extra_fields"] if with_extra_fields else []
        wanted += truncation_hook.v1_fields(self.run.truncation, fields)  # the cut's token ids, V(s_L)
        wanted = list(dict.fromkeys(wanted))
        if not wanted:
            return
        import transfer_queue as tq

        meta = self.batch_meta
        stored = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=wanted)
        if "extra_fields" in wanted:
            self.extra_fields = stored.pop("extra_fields").tolist()
        self.stored = {name: stored[name] for name in wanted if name != "extra_fields"}

    @contextlib.contextmanager
    def in_progress(self) -> Iterator[None]:
        """While verl's step runs, the calls inside it join this one; a non-finite step's error is
        raised when the block ends without another one."""
        outer, self.run.v1 = self.run.v1, self
        try:
            yield
        finally:
            self.run.v1 = outer
        if self.held_error is not None:
            raise self.held_error

    def hold(self, error: Exception) -> None:
        if self.held_error is None:
            self.held_error = error

    def write_transfer_queue(self, batch_meta: Any) -> Any:
        """The one write, after verl's own: the rewards the estimator used where verl stored none (it
        stores them only with KL in the reward), and the trace's row key. Returns the batch meta."""
        import torch

        fields: dict[str, torch.Tensor] = {}
        placed = None if self.advantage_step is None else self.advantage_step.placed
        if placed is not None and "response_mask" in self.stored and not self.run.trainer.config.algorithm.use_kl_in_reward:
            from verl.workers.utils.padding import response_to_nested

            fields["token_level_rewards"] = response_to_nested(placed.rewards, self.stored["response_mask"])
        if self.traced and self.run.trace.update:
            from verl_ext.integration.update_hook import ROW_KEY

            fields[ROW_KEY] = trace_hook.rows(len(batch_meta.keys), self.run.trace.max_samples_per_step)
        if not fields:
            return batch_meta
        import transfer_queue as tq
        from tensordict import TensorDict

        rows = TensorDict(fields, batch_size=len(batch_meta.keys))
        return tq.kv_batch_put(keys=batch_meta.keys, partition_id=batch_meta.partition_id, fields=rows)

    def capture(self) -> None:
        step = self.advantage_step
        if not self.traced or step is None:
            return
        data = self.batch if self.batch is not None else step.data
        tensors = trace_hook.v1_tensors(data, self.stored)
        if step.placed is not None:  # on grpo verl estimates on a copy of the batch, which has them
            tensors["token_level_rewards"] = step.placed.rewards
        extra_fields = self.extra_fields
        def per_sample(key: str) -> list | None:
            return None if extra_fields is None else [e.get(key) if isinstance(e, dict) else None for e in extra_fields]

        step.submit_to_trace(tensors, data.non_tensor_batch.get("uid"), per_sample(TURNS_KEY), per_sample(STOP_REASON_KEY))


def v1_batch_advantaged(data: Any) -> None:
    """The V1 trainer's batch once ``compute_advantage_for_multi_trajectories`` has put the advantages
    on all its rows (on grpo, ``compute_advantage`` sees only each session's last output)."""
    step = current_run().v1
    if step is not None:
        step.batch = data


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


def record_update(reports: dict[str, list[dict]], reduced: dict) -> None:
    """An update's per-token reports (``trace_hook.take_update_reports``), into the trace of the run."""
    run = current_run()
    if run.writer is not None:
        trace_hook.submit_updates(run.writer, int(run.trainer.global_steps), reports, reduced)

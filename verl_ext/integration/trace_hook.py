"""The per-token trace of verl's batch: the functions the advantage step (:mod:`verl_ext.integration.step`)
and the update's metrics call, given the run's writer.

* :func:`open_trace` around ``fit()``: opens the :class:`~verl_ext.trace.writer.TraceWriter` (which
  checks the directory and writes the run record) before the first step, flushes it at the end, also
  when training fails.
* :func:`step_capture`: one step's capture, from the legacy trainer's batch at the end of
  ``compute_advantage``, or from the V1 trainer's batch as verl stores it in TransferQueue
  (:func:`v1_tensors`), with the raw (unwhitened) advantage when the estimator has one and the per-turn
  rewards placed. A traced step (with ``verl_ext.trace.update`` on) carries :data:`~verl_ext.trace.batch_keys.ROW_KEY`,
  which asks the workers for their per-token reports (:func:`rows`).
* :func:`take_update_reports` / :func:`submit_updates` when the trainer reduces an update's metrics: the
  per-token reports of the workers' loss functions (:mod:`update_hook`) become the step's update tables.
"""

from __future__ import annotations

import contextlib
import socket
import sys
from typing import Any, Iterator

import torch

from verl_ext.integration.run_record import run_record
from verl_ext.integration.truncation_hook import eos_token_ids
from verl_ext.options import TraceOptions
from verl_ext.trace.batch_keys import PAYLOAD_KEY


@contextlib.contextmanager
def open_trace(trainer: Any, kind: str, options: TraceOptions, mode: dict | None = None) -> Iterator[Any]:
    """The run's writer (``kind``: "legacy" or "v1"; ``mode``: how the trainer overlaps generation and
    training, :func:`verl_ext.integration.async_modes.run_mode`), for a run with tracing on."""
    from verl_ext.trace.writer import TraceWriter

    record = run_record(trainer.config, kind, options, trainer, mode)
    _say_where_a_cluster_writes(options.dir, record.node)
    with TraceWriter(options, record) as writer:  # never hides fit()'s error
        yield writer


def _say_where_a_cluster_writes(directory: str, node: str | None) -> None:
    """On a multi-node Ray cluster a local trace path is on one node's disk: say which, once, at start."""
    if node is None or ("://" in directory and not directory.startswith("file://")):
        return
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) > 1:
        address = next((n.get("NodeManagerAddress") for n in nodes if n.get("NodeID") == node), "?")
        print(
            f"verl-ext trace: {len(nodes)}-node Ray cluster: {directory} is written on the TaskRunner's node "
            f"{node[:12]} ({address}, host {socket.gethostname()}); for a trace every node can read, use a shared "
            "filesystem or an fsspec URL (s3://, gs://, ...) as verl_ext.trace.dir",
            file=sys.stderr,
            flush=True,
        )


def step_capture(
    trainer: Any,
    batch: Any,
    uid: Any,
    computed: dict[str, torch.Tensor | None],
    kl_coef: float | None,
    agent_turns: Any,
    truncation: Any = None,
    stop_reasons: Any = None,
    whitening: dict[str, float] | None = None,
    rejected: torch.Tensor | None = None,
    logged: dict[str, float] | None = None,
    position: Any = None,
    policy_versions: Any = None,
) -> Any:
    """One step's :class:`~verl_ext.trace.capture.StepCapture`, for the writer. ``batch``: verl's tensors
    under verl's batch keys; ``computed``: the columns verl-ext computed (advantage_raw, kl, turn_score,
    tool_reward; None where there is none);
    ``agent_turns``: the agent loop's record of each sample (one per row, or None); ``truncation``: the
    estimate's :class:`~verl_ext.truncation.Truncation` (None: terminal), whose cut and V(s_L) the
    trace records; ``stop_reasons``: the rollout engine's per sample, or None
    (:mod:`verl_ext.integration.stop_reasons`); ``whitening``: the estimate's statistics of the raw
    advantage the step's advantages were whitened with; ``rejected``: the tokens verl's rollout correction
    took out of the response mask (None: no correction); ``logged``: the numbers verl logged of it (its
    correction's, a fully-async update's counts); ``position``: where the update sits
    (:class:`~verl_ext.integration.async_modes.UpdatePosition`: its trace step, verl's step and sub-step, the
    trainer's version; None: the trainer's step, nothing more); ``policy_versions``: (min, max) per sample as
    verl tagged them (None: not tagged)."""
    from verl_ext.trace.capture import StepCapture
    from verl_ext.trace.schema import FLOAT_COLUMNS

    def get(name: str) -> torch.Tensor | None:
        return batch[name] if name in batch.keys() else None

    prompts = get("prompts")
    prompt_mask = get("prompt_mask")
    if prompt_mask is None and prompts is not None and get("attention_mask") is not None:
        prompt_mask = batch["attention_mask"][:, : prompts.shape[1]]  # verl: prompt part, left-padded
    floats = {column.name: get(column.verl_key) for column in FLOAT_COLUMNS if column.verl_key} | computed
    return StepCapture(
        step=int(trainer.global_steps) if position is None else position.trace_step,
        mask=batch["response_mask"],
        token_id=get("responses"),
        uid=None if uid is None else [str(u) for u in uid],
        floats=floats,
        prompts=prompts,
        prompt_mask=prompt_mask,
        kl_coef=kl_coef,
        eos_token_ids=eos_token_ids(trainer),
        max_response_length=trainer.config.data.get("max_response_length"),
        agent_turns=None if agent_turns is None else list(agent_turns),
        truncation=truncation,
        stop_reasons=None if stop_reasons is None else list(stop_reasons),
        whitening=whitening,
        rejected=rejected,
        logged=logged,
        policy_versions=policy_versions,
        global_step=None if position is None else position.global_step,
        substep=None if position is None else position.substep,
        trainer_version=None if position is None else position.trainer_version,
    )


def rows(batch_size: int, max_samples: int | None = None) -> torch.Tensor:
    """The value of :data:`~verl_ext.trace.batch_keys.ROW_KEY` in a traced batch: each sample's row, which the
    workers' reports name (the token table's ``sample``); -1 for a row past ``max_samples``, which the
    token table leaves out, so that no worker reports it."""
    row = torch.arange(batch_size)
    return row if max_samples is None else torch.where(row < max_samples, row, -1)


#: What the V1 trainer's batch at its advantage step lacks and the trace needs, read from TransferQueue.
V1_TOKEN_FIELDS = ("responses", "prompts")


def v1_tensors(data: Any, stored: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The V1 step's tensors under verl's batch keys, as the legacy batch has them: ``data``, the batch
    verl computed the advantages on and stores (its padded tensors equal TransferQueue's nested ones on
    every response position), and ``stored``, the :data:`V1_TOKEN_FIELDS` read from TransferQueue."""
    tensors = {key: data.batch[key] for key in data.batch.keys()}
    if "responses" in stored:
        tensors["responses"] = _padded(stored["responses"])
    if "prompts" in stored:
        prompts = stored["prompts"]
        tensors["prompts"] = _padded(prompts)  # right-padded here, unlike the legacy batch
        prompt_lengths = prompts.offsets().diff()
        tensors["prompt_mask"] = torch.arange(tensors["prompts"].shape[1]) < prompt_lengths.unsqueeze(1)
    return tensors


def take_update_reports(metrics: dict) -> dict[str, list[dict]]:
    """Remove the workers' per-token reports from an update's metrics: {"actor"|"critic": reports}."""
    reports: dict[str, list[dict]] = {}
    for key in [key for key in metrics if key.endswith(PAYLOAD_KEY)]:
        kind = key.split("/", 1)[0]
        reports.setdefault(kind, []).extend(_flatten(metrics.pop(key)))
    return reports


#: verl's logged metrics of an update that its per-token terms must reproduce (docs/definitions.md §8).
LOGGED = {
    "actor": ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"),
    "critic": ("critic/vf_loss", "critic/vf_clipfrac"),
}


def submit_updates(writer: Any, step: int, reports: dict[str, list[dict]], reduced: dict) -> None:
    """Hand an update's reports (:func:`take_update_reports`) to the writer, with verl's reduced metrics."""
    from verl_ext.trace.update_files import UpdateCapture

    for kind, parts in reports.items():
        if kind not in LOGGED:
            continue
        logged = {key: float(reduced[key]) for key in LOGGED[kind] if key in reduced}
        writer.submit_update(UpdateCapture(step=step, kind=kind, parts=parts, logged=logged))


def _flatten(value: Any) -> Iterator[dict]:
    """verl's gathering nests the reports in lists (per micro-batch, rank, mini-batch): the reports."""
    if isinstance(value, dict):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)


def _padded(value: torch.Tensor) -> torch.Tensor:
    return value.to_padded_tensor(padding=0) if getattr(value, "is_nested", False) else value

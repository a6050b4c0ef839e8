"""The update side of the trace, in the process that trains: a Ray worker, or the in-process runner.

On a batch that carries :data:`~verl_ext.trace.batch_keys.ROW_KEY` (the steps the trace keeps, marked
by :mod:`verl_ext.integration.step`), the wrappers here run verl's own loss functions (``ppo_loss``,
``value_loss``) unchanged and report, for every valid token of each micro-batch, what the update did
with it: the actor's log-prob, ratio, advantage, loss term, clip and entropy; the critic's
prediction, clipped value, return and loss term. Rows are named by the sample's row in the trainer's
batch and by the epoch and mini-batch :func:`tagged_make_iterator` puts on each mini-batch, so they
join the token table whatever shuffling, micro-batching and data parallelism did. The reports of one
update are gathered once into the output of the rank the driver keeps (why, and what verl's metrics
could not carry: the touch record of ``TrainingWorker.train_mini_batch`` in :mod:`verl_ext.touches`).
The loss terms are verl's own (the first matrix its loss hands ``core_algos.agg_loss``); ratio and
clip use verl's vanilla expressions on the inputs its policy-loss function received. Without the row
key every wrapper is a dictionary lookup and a call of the original. What this process keeps
between the calls of one update is one object, :data:`_worker`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch

from verl_ext.trace.batch_keys import EPOCH_KEY, MINIBATCH_KEY, PAYLOAD_KEY, ROW_KEY
from verl_ext.trace.schema import CLIP_CODES, CLIP_DUAL, CLIP_HIGH, CLIP_LOW, CLIP_NONE

#: code -> name, to index with a column of codes
CLIP_NAMES = np.array(CLIP_CODES, dtype=object)

@dataclass
class _Update:
    """One call of verl's ``TrainingWorker.train_mini_batch`` in this process."""

    #: this rank's output reaches the driver (verl's ``is_mp_src_rank_with_outputs``)
    collects: bool
    #: the batch carries :data:`ROW_KEY` (seen by :func:`tagged_make_iterator`)
    traced: bool = False
    #: this rank's reports, until the update ends
    reports: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _WorkerState:
    """What this process keeps between the calls of one update: the update in progress (None outside
    verl's update method) and, per kind, ((epoch, minibatch), index of its last micro-batch)."""

    update: _Update | None = None
    microbatches: dict[str, tuple[tuple[int, int], int]] = field(default_factory=dict)


_worker = _WorkerState()


def traced_train_mini_batch(original: Callable, worker, data):
    """verl's ``TrainingWorker.train_mini_batch``; on a traced batch, the reports of every data-parallel
    rank gathered once into the output of the rank the driver keeps (rank 0 of the group)."""
    engine = worker.engine
    update = _Update(collects=bool(engine.is_mp_src_rank_with_outputs()))
    outer, _worker.update = _worker.update, update
    try:
        output = original(worker, data)
    finally:
        _worker.update = outer
    if not (update.traced and update.collects):
        return output
    gathered = gather_to_group_rank_0(update.reports, engine.get_data_parallel_group())
    if gathered is not None:
        from verl.utils import tensordict_utils as tu

        tu.assign_non_tensor(output, metrics={**tu.get(output, "metrics"), PAYLOAD_KEY: gathered})
    return output


def gather_to_group_rank_0(reports: list[dict[str, Any]], group) -> list[dict[str, Any]] | None:
    """Every rank's ``reports`` of ``group``, on its rank 0 (None on the others): one collective,
    where verl's all-gather of the metrics would have been one copy per rank."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return reports
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    received: list[Any] | None = [None] * size if rank == 0 else None
    dist.gather_object(reports, received, dst=dist.get_global_rank(group, 0), group=group)
    return None if received is None else [report for rank_reports in received for report in rank_reports]


def tagged_make_iterator(original: Callable, tensordict, mini_batch_size, epochs, seed=None, dataloader_kwargs=None):
    """verl's mini-batch iterator; on a traced batch each mini-batch is tagged with its epoch and index."""
    iterator = original(tensordict, mini_batch_size, epochs, seed=seed, dataloader_kwargs=dataloader_kwargs)
    if ROW_KEY not in tensordict.keys():
        return iterator
    if _worker.update is not None:
        _worker.update.traced = True
    per_epoch = tensordict.batch_size[0] // mini_batch_size
    _worker.microbatches.clear()  # a new update of one model begins

    def tagged() -> Iterator:
        from verl.utils import tensordict_utils as tu

        for index, mini_batch in enumerate(iterator):
            tu.assign_non_tensor(mini_batch, **{EPOCH_KEY: index // per_epoch, MINIBATCH_KEY: index % per_epoch})
            yield mini_batch

    return tagged()


def traced_ppo_loss(original: Callable, config, model_output, data, dp_group=None):
    """verl's ``ppo_loss``, and on a traced batch the actor's per-token report (:func:`_deliver`)."""
    if not _reports_here(data):
        return original(config, model_output, data, dp_group)
    from verl.trainer.ppo import core_algos
    from verl.workers.utils.padding import no_padding_2_padding

    mode = config.policy_loss.get("loss_mode", "vanilla")
    seen: dict[str, Any] = {}
    with recording_loss(core_algos, seen, policy_loss_mode=mode):
        loss, metrics = original(config, model_output, data, dp_group)
    inputs = seen["policy_inputs"]
    log_prob, old_log_prob = inputs["log_prob"].detach(), inputs["old_log_prob"]
    advantages, mask = inputs["advantages"], inputs["response_mask"].bool()
    ratio, clip = ratio_and_clip(log_prob, old_log_prob, advantages, *clip_bounds(config), config.clip_ratio_c)
    entropy = model_output.get("entropy", None)
    columns = {
        "log_prob": log_prob,
        "old_log_prob": old_log_prob,
        "ratio": ratio,
        "advantage": advantages,
        "pg_loss": seen["loss_mat"].detach(),
        "clip": clip,
        "entropy": None if entropy is None else no_padding_2_padding(entropy, data).detach(),
        "is_weight": inputs.get("rollout_is_weights"),
    }
    _deliver(metrics, _report("actor", data, mask, columns, dp_group))
    return loss, metrics


def ratio_and_clip(log_prob, old_log_prob, advantages, low: float, high: float, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio, clip code: an index into CLIP_CODES), elementwise, by compute_policy_loss_vanilla's own
    expressions (verl's core_algos): ratio = exp(clamp(log_prob − old_log_prob, −20, 20)); the term is
    clipped where −A·clamp(ratio, 1−ε_low, 1+ε_high) > −A·ratio, dual-clipped where A < 0 and the
    clipped term exceeds −A·c."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clipped = torch.gt(pg_losses2, pg_losses1)
    dual = torch.gt(torch.maximum(pg_losses1, pg_losses2), -advantages * c) & (advantages < 0)
    code = CLIP_CODES.index
    clip = torch.where(dual, code(CLIP_DUAL), torch.where(clipped, torch.where(advantages < 0, code(CLIP_LOW), code(CLIP_HIGH)), code(CLIP_NONE)))
    return ratio, clip


def clip_bounds(actor: Any) -> tuple[float, float]:
    """(ε_low, ε_high) of the PPO clip as verl resolves them: ``clip_ratio_low`` and ``clip_ratio_high``
    where set, else ``clip_ratio`` (verl's default 0.2). ``actor``: the actor's config, as the loss
    function receives it or as the trainer's config holds it (both answer ``get``)."""
    clip = actor.get("clip_ratio", 0.2)
    low, high = actor.get("clip_ratio_low"), actor.get("clip_ratio_high")
    return (clip if low is None else low, clip if high is None else high)


def traced_value_loss(original: Callable, config, model_output, data, dp_group=None):
    """verl's ``value_loss``, and on a traced batch the critic's per-token report (:func:`_deliver`)."""
    if not _reports_here(data):
        return original(config, model_output, data, dp_group)
    import verl.utils.torch_functional as verl_F
    from verl.trainer.ppo import core_algos
    from verl.workers.utils.padding import no_padding_2_padding

    seen: dict[str, Any] = {}
    with recording_loss(core_algos, seen):
        loss, metrics = original(config, model_output, data, dp_group)
    vpreds = no_padding_2_padding(model_output["values"], data).detach()
    padded = data.select("values", "returns", "response_mask").to_padded_tensor()  # as value_loss does
    values, returns, mask = padded["values"], padded["returns"], padded["response_mask"].bool()
    # compute_value_loss's own expressions (verl's core_algos)
    clipped = verl_F.clip_by_value(vpreds, values - config.cliprange_value, values + config.cliprange_value)
    columns = {
        "vpred": vpreds,
        "vpred_clipped": clipped,
        "value": values,
        "return": returns,
        "vf_loss": seen["loss_mat"].detach(),
        "vf_clipped": torch.gt((clipped - returns) ** 2, (vpreds - returns) ** 2),
    }
    _deliver(metrics, _report("critic", data, mask, columns, dp_group))
    return loss, metrics


def _reports_here(data) -> bool:
    """A traced batch, on a rank whose output reaches the driver (or outside verl's update method)."""
    return ROW_KEY in data.keys() and (_worker.update is None or _worker.update.collects)


def _deliver(metrics: dict, report: dict[str, Any]) -> None:
    """Into the update in progress, gathered when it ends; outside one, into the loss metrics."""
    if _worker.update is not None:
        _worker.update.reports.append(report)
    else:
        metrics[PAYLOAD_KEY] = [report]


def _report(kind: str, data, mask: torch.Tensor, columns: dict[str, torch.Tensor | None], dp_group) -> dict[str, Any]:
    """The valid tokens of the traced rows of one micro-batch as numpy columns, with where they were
    trained (no row past ``max_samples_per_step``: those carry -1 in :data:`ROW_KEY`).

    In the loss metrics (:func:`_deliver`), a list around the report keeps verl's metric flattening
    (``chain.from_iterable``) from iterating into the dictionary.
    """
    from verl.utils import tensordict_utils as tu

    sample_of_row = data[ROW_KEY].to(mask.device)
    row, token = torch.nonzero(mask & (sample_of_row >= 0).unsqueeze(1), as_tuple=True)
    report_columns = {
        "sample": sample_of_row[row].cpu().numpy().astype(np.int32),
        "token_index": token.cpu().numpy().astype(np.int32),
    }
    for name, tensor in columns.items():
        if tensor is None:
            continue
        values = tensor[row, token].cpu()
        if name == "clip":
            report_columns[name] = CLIP_NAMES[values.numpy()]
        elif tensor.dtype == torch.bool:
            report_columns[name] = values.numpy()
        else:  # read in float32 whatever the engine computed in (bf16 under verl's GPU defaults)
            report_columns[name] = values.float().numpy()
    epoch, minibatch = int(tu.get(data, EPOCH_KEY, 0)), int(tu.get(data, MINIBATCH_KEY, 0))
    previous = _worker.microbatches.get(kind)
    microbatch = previous[1] + 1 if previous is not None and previous[0] == (epoch, minibatch) else 0
    _worker.microbatches[kind] = ((epoch, minibatch), microbatch)
    rank = torch.distributed.get_rank(group=dp_group) if torch.distributed.is_initialized() else 0
    return {
        "epoch": epoch,
        "minibatch": minibatch,
        "microbatch": microbatch,
        "rank": rank,
        "batch_num_tokens": _integer(tu.get(data, "batch_num_tokens", None)),
        "global_batch_size": _integer(tu.get(data, "global_batch_size", None)),
        "dp_size": _integer(tu.get(data, "dp_size", None)),
        "valid_tokens": int(mask.sum()),  # traced or not: a call with none still counts in verl's metric means
        "columns": report_columns,
    }


def _integer(value) -> int | None:
    return None if value is None else int(value)


@contextlib.contextmanager
def recording_loss(core_algos, seen: dict[str, Any], policy_loss_mode: str | None = None):
    """While verl's loss runs: the first loss matrix given to ``core_algos.agg_loss``, and the inputs
    of the registered policy-loss function. Both are put back afterwards, even on error."""
    aggregate = core_algos.agg_loss
    registry = core_algos.POLICY_LOSS_REGISTRY
    policy_loss = registry.get(policy_loss_mode) if policy_loss_mode is not None else None

    def recording_agg_loss(*args, **kwargs):
        seen.setdefault("loss_mat", kwargs["loss_mat"] if "loss_mat" in kwargs else args[0])
        return aggregate(*args, **kwargs)

    def recording_policy_loss(**kwargs):
        seen.setdefault("policy_inputs", kwargs)
        return policy_loss(**kwargs)

    core_algos.agg_loss = recording_agg_loss
    if policy_loss is not None:
        registry[policy_loss_mode] = recording_policy_loss
    try:
        yield
    finally:
        core_algos.agg_loss = aggregate
        if policy_loss is not None:
            registry[policy_loss_mode] = policy_loss

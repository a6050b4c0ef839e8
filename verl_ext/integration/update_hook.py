"""The update side of the trace, in the process that trains: a Ray worker, or the in-process runner.

verl computes each micro-batch's loss in its workers' loss functions (``verl.workers.utils.losses``
``ppo_loss`` and ``value_loss``), on padded (b, T) response tensors. When the batch carries
:data:`ROW_KEY` (the trainer's side adds it to the steps it traces, :mod:`step`), the wrappers
here run verl's own loss function unchanged and report, for every valid token of the micro-batch,
what the update did with it: the actor's log-prob, ratio, advantage, per-token loss term, clip and
entropy; the critic's prediction, its clipped value, return and per-token loss term. The rows are
named by :data:`ROW_KEY` (the sample's row in the trainer's batch) and by the epoch and mini-batch
that :func:`tagged_make_iterator` adds to each mini-batch, so that they join the token table
whatever shuffling, micro-batching and data parallelism did to them.

The report travels back in the loss function's metrics under :data:`PAYLOAD_KEY`: verl gathers
those across ranks, micro-batches and mini-batches and returns them to the trainer, where the
trace takes them out before verl reduces its metrics. Without :data:`ROW_KEY` every wrapper is a
dictionary lookup and a call of the original.

The per-token loss terms are verl's own: while the loss runs, the first matrix it hands to
``core_algos.agg_loss`` (the per-token policy-loss term of any registered loss mode, or the
critic's ``max((v̂−R)², (clip(v̂)−R)²)``) and the exact inputs of the configured policy-loss function
are recorded. Ratio and clip use verl's vanilla expressions on those inputs.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import numpy as np
import torch

from verl_ext.trace.schema import CLIP_CODES, CLIP_DUAL, CLIP_HIGH, CLIP_LOW, CLIP_NONE

#: code -> name, to index with a column of codes
_CLIP_NAMES = np.array(CLIP_CODES, dtype=object)

#: (B,) int64 tensor in the batch: the sample's row in the trainer's batch (the token table's ``sample``).
ROW_KEY = "verl_ext_row"
#: Non-tensor values :func:`tagged_make_iterator` puts on each mini-batch.
EPOCH_KEY, MINIBATCH_KEY = "verl_ext_epoch", "verl_ext_minibatch"
#: Key of the report in a loss function's metrics (verl prefixes it with "actor/" or "critic/").
PAYLOAD_KEY = "verl_ext/update"

#: The micro-batch counter of this process, per kind: ((epoch, minibatch), index of its last micro-batch).
_microbatches: dict[str, tuple[tuple[int, int], int]] = {}


def tagged_make_iterator(original: Callable, tensordict, mini_batch_size, epochs, seed=None, dataloader_kwargs=None):
    """verl's mini-batch iterator; on a traced batch each mini-batch is tagged with its epoch and index."""
    iterator = original(tensordict, mini_batch_size, epochs, seed=seed, dataloader_kwargs=dataloader_kwargs)
    if ROW_KEY not in tensordict.keys():
        return iterator
    per_epoch = tensordict.batch_size[0] // mini_batch_size
    _microbatches.clear()  # a new update of one model begins

    def tagged() -> Iterator:
        from verl.utils import tensordict_utils as tu

        for index, mini_batch in enumerate(iterator):
            tu.assign_non_tensor(mini_batch, **{EPOCH_KEY: index // per_epoch, MINIBATCH_KEY: index % per_epoch})
            yield mini_batch

    return tagged()


def traced_ppo_loss(original: Callable, config, model_output, data, dp_group=None):
    """verl's ``ppo_loss``, and on a traced batch the actor's per-token report in its metrics."""
    if ROW_KEY not in data.keys():
        return original(config, model_output, data, dp_group)
    from verl.trainer.ppo import core_algos
    from verl.workers.utils.padding import no_padding_2_padding

    mode = config.policy_loss.get("loss_mode", "vanilla")
    seen: dict[str, Any] = {}
    with _recording(core_algos, seen, policy_loss_mode=mode):
        loss, metrics = original(config, model_output, data, dp_group)
    inputs = seen["policy_inputs"]
    log_prob, old_log_prob = inputs["log_prob"].detach(), inputs["old_log_prob"]
    advantages, mask = inputs["advantages"], inputs["response_mask"].bool()
    # compute_policy_loss_vanilla's own expressions (core_algos.py:1327-1364)
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    low, high = clip_bounds(config)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clipped = torch.gt(pg_losses2, pg_losses1)
    dual = torch.gt(torch.maximum(pg_losses1, pg_losses2), -advantages * config.clip_ratio_c) & (advantages < 0)
    code = CLIP_CODES.index
    clip = torch.where(dual, code(CLIP_DUAL), torch.where(clipped, torch.where(advantages < 0, code(CLIP_LOW), code(CLIP_HIGH)), code(CLIP_NONE)))
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
    metrics[PAYLOAD_KEY] = [_report("actor", data, mask, columns, dp_group)]
    return loss, metrics


def clip_bounds(actor: Any) -> tuple[float, float]:
    """(ε_low, ε_high) of the PPO clip as verl resolves them: ``clip_ratio_low`` and ``clip_ratio_high``
    where set, else ``clip_ratio`` (verl's default 0.2). ``actor``: the actor's config, as the loss
    function receives it or as the trainer's config holds it (both answer ``get``)."""
    clip = actor.get("clip_ratio", 0.2)
    low, high = actor.get("clip_ratio_low"), actor.get("clip_ratio_high")
    return (clip if low is None else low, clip if high is None else high)


def traced_value_loss(original: Callable, config, model_output, data, dp_group=None):
    """verl's ``value_loss``, and on a traced batch the critic's per-token report in its metrics."""
    if ROW_KEY not in data.keys():
        return original(config, model_output, data, dp_group)
    import verl.utils.torch_functional as verl_F
    from verl.trainer.ppo import core_algos
    from verl.workers.utils.padding import no_padding_2_padding

    seen: dict[str, Any] = {}
    with _recording(core_algos, seen):
        loss, metrics = original(config, model_output, data, dp_group)
    vpreds = no_padding_2_padding(model_output["values"], data).detach()
    padded = data.select("values", "returns", "response_mask").to_padded_tensor()  # as value_loss does
    values, returns, mask = padded["values"], padded["returns"], padded["response_mask"].bool()
    # compute_value_loss's own expressions (core_algos.py:2171-2184)
    clipped = verl_F.clip_by_value(vpreds, values - config.cliprange_value, values + config.cliprange_value)
    columns = {
        "vpred": vpreds,
        "vpred_clipped": clipped,
        "value": values,
        "return": returns,
        "vf_loss": seen["loss_mat"].detach(),
        "vf_clipped": torch.gt((clipped - returns) ** 2, (vpreds - returns) ** 2),
    }
    metrics[PAYLOAD_KEY] = [_report("critic", data, mask, columns, dp_group)]
    return loss, metrics


def _report(kind: str, data, mask: torch.Tensor, columns: dict[str, torch.Tensor | None], dp_group) -> dict[str, Any]:
    """The valid tokens of one micro-batch as numpy columns, with where they were trained.

    A list around the report keeps verl's metric flattening (``chain.from_iterable``) from
    iterating into the dictionary (one list level per gathering step is removed or added).
    """
    from verl.utils import tensordict_utils as tu

    row, token = torch.nonzero(mask, as_tuple=True)
    report_columns = {
        "sample": data[ROW_KEY].to(row.device)[row].cpu().numpy().astype(np.int32),
        "token_index": token.cpu().numpy().astype(np.int32),
    }
    for name, tensor in columns.items():
        if tensor is None:
            continue
        values = tensor[row, token].cpu()
        report_columns[name] = _CLIP_NAMES[values.numpy()] if name == "clip" else values.numpy().astype(
            np.bool_ if tensor.dtype == torch.bool else np.float32
        )
    epoch, minibatch = int(tu.get(data, EPOCH_KEY, 0)), int(tu.get(data, MINIBATCH_KEY, 0))
    previous = _microbatches.get(kind)
    microbatch = previous[1] + 1 if previous is not None and previous[0] == (epoch, minibatch) else 0
    _microbatches[kind] = ((epoch, minibatch), microbatch)
    rank = torch.distributed.get_rank(group=dp_group) if torch.distributed.is_initialized() else 0
    return {
        "epoch": epoch,
        "minibatch": minibatch,
        "microbatch": microbatch,
        "rank": rank,
        "batch_num_tokens": _integer(tu.get(data, "batch_num_tokens", None)),
        "global_batch_size": _integer(tu.get(data, "global_batch_size", None)),
        "dp_size": _integer(tu.get(data, "dp_size", None)),
        "columns": report_columns,
    }


def _integer(value) -> int | None:
    return None if value is None else int(value)


@contextlib.contextmanager
def _recording(core_algos, seen: dict[str, Any], policy_loss_mode: str | None = None):
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

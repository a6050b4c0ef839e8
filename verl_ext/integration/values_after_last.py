"""V(s_L), the critic's value after each response's last token, kept for ``algorithm.truncation=bootstrap``.

verl's critic returns one value per token of the whole sequence (nested, no padding: prompt then
response); the driver keeps the response's values with a slice shifted left by one token
(``workers/utils/padding.py``: ``values[seq_offset - resp_len - 1 : seq_offset - 1]``, the value of
response token t being the output at the token before it, the state s_t). The output at the last
token itself, index ``seq_offset - 1``, is the state after the last token, s_L: computed and dropped.

Both trainers slice on the driver, through one name bound in their module: the legacy
``RayPPOTrainer._compute_values`` calls ``no_padding_2_padding``, the V1 ``PPOTrainer._compute_values``
calls ``response_from_nested``. While verl's method runs on a bootstrap run, that name is a
pass-through to verl's function that also reads the one value past each slice from the same tensor;
verl's values are verl's function's result, untouched. Then the one value per response is stored
beside ``values``: a batch key of the legacy batch (float32, as verl upcasts ``values`` there), a
TransferQueue field of the V1 trainer (in the dtype verl stores ``values``). Any other run calls
verl's method and nothing else.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import torch

from verl_ext.truncation import VALUES_AFTER_LAST  # the batch key (legacy) and TransferQueue field (V1), (B,)


def bootstrap_asked(config: Any) -> bool:
    """True when the run's ``algorithm.truncation`` is ``bootstrap`` (the driver's trainer config)."""
    from verl_ext.integration.truncation_hook import mode_of

    return mode_of(config.get("algorithm")) == "bootstrap"


def after_last_token(full_values: torch.Tensor, sequence_ends: torch.Tensor) -> torch.Tensor:
    """The output at each sequence's last token: ``full_values`` (total_nnz, ...) or a nested tensor of
    whole sequences, ``sequence_ends`` the cumulative sequence lengths (B,) (each sequence's end offset).
    Index ``end - 1`` is the token one past the last of verl's ``[end - L - 1, end - 1)`` slices."""
    flat = full_values.values() if full_values.is_nested else full_values
    return flat[sequence_ends.to(device=flat.device, dtype=torch.long) - 1]


def padded_sequence_ends(data: Any) -> torch.Tensor:
    """Sequence end offsets exactly as ``no_padding_2_padding`` computes them from the batch it is given."""
    prompt_ids = data["prompts"]
    if prompt_ids.is_nested:
        lengths = prompt_ids.offsets().diff() + data["responses"].offsets().diff()
    else:
        lengths = data["attention_mask"].sum(dim=1)  # prompt part + response part of the same mask
    return lengths.cumsum(dim=0)


class _Kept:
    """What the pass-through read during one call of verl's method."""

    def __init__(self) -> None:
        self.values_after_last: torch.Tensor | None = None
        self.thread = threading.get_ident()

    def keep(self, value: torch.Tensor) -> None:
        if self.values_after_last is not None:
            raise RuntimeError(
                "verl's _compute_values sliced values twice; verl-ext cannot tell which slice is the critic's "
                "(algorithm.truncation=bootstrap needs verl-ext's touch updated for this verl)"
            )
        self.values_after_last = value


@contextlib.contextmanager
def _pass_through(module: Any, name: str, read: Callable[..., torch.Tensor]) -> Iterator[_Kept]:
    """``module.name`` calls verl's function and keeps ``read(*its arguments)`` while the block runs
    (calls from other threads pass straight through)."""
    verls = getattr(module, name)
    kept = _Kept()

    @functools.wraps(verls)
    def slicing(*args, **kwargs):
        sliced = verls(*args, **kwargs)  # first: verl's own checks of the layout run before the read
        if threading.get_ident() == kept.thread:
            kept.keep(read(*args, **kwargs))
        return sliced

    setattr(module, name, slicing)
    try:
        yield kept
    finally:
        setattr(module, name, verls)


def _read_padded(tensor: torch.Tensor, data: Any) -> torch.Tensor:
    return after_last_token(tensor, padded_sequence_ends(data))


def _read_nested(tensor: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return after_last_token(tensor, tensor.offsets()[1:])


def _missing(trainer: str) -> RuntimeError:
    return RuntimeError(
        f"algorithm.truncation=bootstrap: verl's {trainer} _compute_values did not slice the critic's values "
        "through the function verl-ext reads V(s_L) from; this verl is not the one verl-ext's touch was written for"
    )


# --------------------------------------------------------------------------- the touches (verl_ext.integration.patches)


def legacy_values(original: Callable, trainer: Any, batch: Any) -> Any:
    """``RayPPOTrainer._compute_values``: verl's result, plus ``values_after_last`` on a bootstrap run."""
    if not bootstrap_asked(trainer.config):
        return original(trainer, batch)
    import verl.trainer.ppo.ray_trainer as ray_trainer

    with _pass_through(ray_trainer, "no_padding_2_padding", _read_padded) as kept:
        values = original(trainer, batch)
    if kept.values_after_last is None:
        raise _missing("legacy")
    values.batch[VALUES_AFTER_LAST] = kept.values_after_last.float()  # as verl upcasts values
    return values


def v1_values(original: Callable, trainer: Any, batch: Any, metrics: dict) -> Any:
    """``PPOTrainer._compute_values`` (V1): verl's result, plus the TransferQueue field
    ``values_after_last`` on a bootstrap run, named in the batch meta's ``fields`` (verl names there what
    was stored when its meta was last returned by a put, which ``values`` is not: the advantage step
    reads the fields it lists)."""
    if not bootstrap_asked(trainer.config):
        return original(trainer, batch, metrics)
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    from tensordict import TensorDict

    with _pass_through(trainer_base, "response_from_nested", _read_nested) as kept:
        batch = original(trainer, batch, metrics)
    if kept.values_after_last is None:
        raise _missing("V1")
    fields = TensorDict({VALUES_AFTER_LAST: kept.values_after_last}, batch_size=[len(batch.keys)])
    trainer_base.tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)
    if batch.fields is not None and VALUES_AFTER_LAST not in batch.fields:
        batch.fields = [*batch.fields, VALUES_AFTER_LAST]
    return batch

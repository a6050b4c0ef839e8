"""V(s_L), the critic's value after each response's last token, kept by verl's own ``_compute_values`` on
both trainers when ``algorithm.truncation=bootstrap`` (verl_ext.integration.values_after_last).

The reference is a separate forward pass of a real value model (a tiny transformers
``LlamaForTokenClassification`` with one label, the class verl builds its critic from) on each full
sequence alone, unpadded: its output at the sequence's last token. The driver side runs verl's
installed ``_compute_values`` (the patched one, as the trainer calls it); the critic worker is a stand-in
that runs verl's FSDP value engine's own input and output code (``prepare_model_inputs`` /
``prepare_model_outputs``) around that model, packed (``use_remove_padding=True``) or padded.
``values`` are compared with verl's unpatched method on the same batch.
"""

from __future__ import annotations

from types import MethodType, SimpleNamespace

import pytest
import torch

from verl_ext.integration.values_after_last import (
    VALUES_AFTER_LAST,
    after_last_token,
    bootstrap_asked,
    padded_sequence_ends,
)
from verl_ext.patching import ORIGINAL_ATTR

PAD = 0
MAX_PROMPT, MAX_RESPONSE = 5, 6
#: (prompt, response): a response cut at MAX_RESPONSE, shorter ones, a one-token prompt and response
ROWS = [
    ([5, 6, 7], [8, 9, 10, 11, 12, 13]),
    ([14, 15, 16, 17, 18], [19, 20]),
    ([21], [22, 23, 24, 25]),
    ([26, 27], [28]),
    ([29, 30, 31, 32], [33, 34, 35, 36, 37, 38]),
]


# --------------------------------------------------------------------------- the layouts by hand


def test_the_value_after_the_last_token_of_nested_sequences():
    # sequences of 3+2, 1+1 and 2+3 tokens; values numbered by their flat position
    offsets = torch.tensor([0, 5, 7, 12])
    nested = torch.nested.nested_tensor_from_jagged(torch.arange(12.0) * 10, offsets=offsets)
    assert after_last_token(nested, offsets[1:]).tolist() == [40.0, 60.0, 110.0]
    # verl's slice for response token t of sequence b is [end - L - 1, end - 1): the kept index is one past it
    from verl.workers.utils.padding import response_from_nested

    response_mask = torch.nested.as_nested_tensor([torch.ones(2), torch.ones(1), torch.ones(3)], layout=torch.jagged)
    sliced = response_from_nested(nested, response_mask)
    assert [row.tolist() for row in sliced.unbind()] == [[20.0, 30.0], [50.0], [80.0, 90.0, 100.0]]


def test_the_sequence_ends_of_a_left_and_right_padded_batch():
    # prompt part left-padded (lengths 2, 3, 1), response part right-padded (lengths 3, 1, 2)
    attention_mask = torch.tensor([
        [0, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 0, 0],
    ])  # fmt: skip
    data = {"prompts": torch.zeros(3, 3, dtype=torch.long), "attention_mask": attention_mask}
    assert padded_sequence_ends(data).tolist() == [5, 9, 12]
    flat = torch.arange(12.0)
    assert after_last_token(flat, padded_sequence_ends(data)).tolist() == [4.0, 8.0, 11.0]


def test_the_option_is_read_from_the_trainers_algorithm_config():
    from omegaconf import OmegaConf

    assert bootstrap_asked(OmegaConf.create({"algorithm": {"truncation": "bootstrap"}}))
    assert not bootstrap_asked(OmegaConf.create({"algorithm": {"truncation": "terminal"}}))
    assert not bootstrap_asked(OmegaConf.create({"algorithm": {"truncation": "mask"}}))
    assert not bootstrap_asked(OmegaConf.create({"algorithm": {"gamma": 1.0}}))


# --------------------------------------------------------------------------- a real critic


@pytest.fixture(scope="module")
def critic():
    from transformers import LlamaConfig, LlamaForTokenClassification

    config = LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, pad_token_id=PAD, num_labels=1,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForTokenClassification(config).eval()


def separate_forward(critic, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The critic's output at every position of one full sequence, alone and unpadded."""
    input_ids = torch.tensor([prompt + response])
    with torch.no_grad():
        return critic(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
            position_ids=torch.arange(input_ids.shape[1])[None],
        ).logits[0, :, 0]  # fmt: skip


class ValueEngine:
    """verl's FSDP value engine's input and output code around ``critic`` (one micro-batch, no Ulysses)."""

    def __init__(self, critic, use_remove_padding: bool, dtype: torch.dtype = torch.float32):
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine, FSDPEngineWithValueHead

        self.module, self.use_remove_padding, self.dtype = critic, use_remove_padding, dtype
        self.pad_to_length, self.use_ulysses_sp = False, False
        for name, function in {
            "prepare_model_inputs": FSDPEngineWithValueHead.prepare_model_inputs,
            "prepare_model_outputs": FSDPEngineWithValueHead.prepare_model_outputs,
            "_get_packed_pad_size": FSDPEngine._get_packed_pad_size,
            "_gather_and_unpad_packed": FSDPEngine._gather_and_unpad_packed,
        }.items():
            setattr(self, name, MethodType(function, self))

    def values(self, data) -> torch.Tensor:
        """The nested whole-sequence values verl's critic worker returns for ``data`` (nested input_ids)."""
        from tensordict import TensorDict
        from verl.utils import tensordict_utils as tu

        micro_batch = TensorDict(
            {"input_ids": data["input_ids"], "position_ids": data["position_ids"]}, batch_size=data.batch_size
        )
        tu.assign_non_tensor(micro_batch, use_remove_padding=self.use_remove_padding, temperature=1.0)
        model_inputs, output_args = self.prepare_model_inputs(micro_batch)
        with torch.no_grad():
            output = self.module(**model_inputs, use_cache=False)
            values = self.prepare_model_outputs(output, output_args, micro_batch, None)["values"]
        return torch.nested.nested_tensor_from_jagged(values.values().to(self.dtype), offsets=values.offsets())


def padded_batch():
    """The trainer's batch of :data:`ROWS`: prompts left-padded, responses right-padded."""
    prompts = torch.tensor([[PAD] * (MAX_PROMPT - len(p)) + p for p, _ in ROWS])
    responses = torch.tensor([r + [PAD] * (MAX_RESPONSE - len(r)) for _, r in ROWS])
    prompt_mask = torch.tensor([[0] * (MAX_PROMPT - len(p)) + [1] * len(p) for p, _ in ROWS])
    response_mask = torch.tensor([[1] * len(r) + [0] * (MAX_RESPONSE - len(r)) for _, r in ROWS])
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "response_mask": response_mask,
    }


def expected(critic) -> tuple[torch.Tensor, torch.Tensor]:
    """(V(s_L) per row, V(s_t) per response token, zero-padded) from separate forward passes."""
    after_last, per_token = [], torch.zeros(len(ROWS), MAX_RESPONSE)
    for row, (prompt, response) in enumerate(ROWS):
        head = separate_forward(critic, prompt, response)
        after_last.append(head[-1])
        per_token[row, : len(response)] = head[len(prompt) - 1 : len(prompt) + len(response) - 1]
    return torch.stack(after_last), per_token


def trainer_config(truncation: str | None):
    from omegaconf import OmegaConf

    algorithm = {"gamma": 1.0} if truncation is None else {"gamma": 1.0, "truncation": truncation}
    return OmegaConf.create({"algorithm": algorithm, "actor_rollout_ref": {"rollout": {"temperature": 1.0}}})


# --------------------------------------------------------------------------- the legacy trainer


def legacy_trainer(engine: ValueEngine, truncation: str | None):
    def infer_batch(data):
        values = engine.values(data.clone())  # the worker gets a copy of the driver's batch
        return SimpleNamespace(get=lambda: {"values": values})

    return SimpleNamespace(config=trainer_config(truncation), critic_wg=SimpleNamespace(infer_batch=infer_batch))


def legacy_values(trainer, verls: bool = False):
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    method = RayPPOTrainer._compute_values
    method = getattr(method, ORIGINAL_ATTR) if verls else method
    return method(trainer, DataProto.from_dict(tensors=padded_batch()))


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["packed", "padded"])
def test_legacy_trainer_keeps_the_critics_value_after_the_last_token(critic, use_remove_padding):
    engine = ValueEngine(critic, use_remove_padding)
    kept = legacy_values(legacy_trainer(engine, "bootstrap")).batch
    verls = legacy_values(legacy_trainer(engine, "bootstrap"), verls=True).batch

    after_last, per_token = expected(critic)
    assert kept[VALUES_AFTER_LAST].dtype == kept["values"].dtype == torch.float32
    torch.testing.assert_close(kept[VALUES_AFTER_LAST], after_last, atol=1e-5, rtol=0)
    assert torch.equal(kept["values"], verls["values"])  # verl's values, untouched
    torch.testing.assert_close(kept["values"], per_token, atol=1e-5, rtol=0)  # the stand-in is verl's critic
    # V(s_L) is not any of the values verl keeps: for the cut response it is one past the last
    assert not torch.isclose(kept[VALUES_AFTER_LAST][0], kept["values"][0, -1])


@pytest.mark.parametrize("truncation", [None, "terminal", "mask"])
def test_legacy_trainer_without_bootstrap_is_verls_method_alone(critic, truncation):
    import verl.trainer.ppo.ray_trainer as ray_trainer

    slicing = ray_trainer.no_padding_2_padding
    engine = ValueEngine(critic, use_remove_padding=True)
    values = legacy_values(legacy_trainer(engine, truncation)).batch
    assert set(values.keys()) == {"values"}
    assert torch.equal(values["values"], legacy_values(legacy_trainer(engine, truncation), verls=True).batch["values"])
    assert ray_trainer.no_padding_2_padding is slicing


def test_the_slicing_name_is_verls_again_after_a_failed_call(critic):
    import verl.trainer.ppo.ray_trainer as ray_trainer

    slicing = ray_trainer.no_padding_2_padding

    def infer_batch(data):
        raise RuntimeError("the critic worker died")

    trainer = SimpleNamespace(config=trainer_config("bootstrap"), critic_wg=SimpleNamespace(infer_batch=infer_batch))
    with pytest.raises(RuntimeError, match="the critic worker died"):
        legacy_values(trainer)
    assert ray_trainer.no_padding_2_padding is slicing


# --------------------------------------------------------------------------- the V1 trainer


class FakeTransferQueue:
    """``kv_batch_get`` / ``kv_batch_put`` over a dict: per row and field one tensor; a get returns
    the rows of each field nested (jagged) when they have a length, stacked when they are scalars."""

    def __init__(self):
        self.rows: dict[tuple[str, str], torch.Tensor] = {}

    def kv_batch_put(self, keys, partition_id, fields=None, tags=None):
        for name in fields.keys():
            column = fields[name]
            rows = column.unbind() if column.is_nested else column.unbind(0)
            for key, row in zip(keys, rows, strict=True):
                self.rows[(key, name)] = row.clone()
        return None

    def kv_batch_get(self, keys, partition_id, select_fields):
        from tensordict import TensorDict

        columns = {}
        for name in select_fields:
            rows = [self.rows[(key, name)] for key in keys]
            scalar = rows[0].dim() == 0
            columns[name] = torch.stack(rows) if scalar else torch.nested.as_nested_tensor(rows, layout=torch.jagged)
        return TensorDict(columns, batch_size=[len(keys)])

    def column(self, keys, name):
        return [self.rows[(key, name)] for key in keys]


def v1_run(monkeypatch, critic, use_remove_padding: bool, truncation: str | None, verls: bool = False, dtype=torch.float32):
    """verl's V1 ``_compute_values`` on :data:`ROWS` stored as the V1 trainer stores them (nested, no
    padding); the critic worker reads its input from the queue and writes the whole-sequence values."""
    import verl.trainer.ppo.v1.trainer_base as trainer_base
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    queue = FakeTransferQueue()
    monkeypatch.setattr(trainer_base.tq, "kv_batch_get", queue.kv_batch_get)
    monkeypatch.setattr(trainer_base.tq, "kv_batch_put", queue.kv_batch_put)
    monkeypatch.setattr(trainer_base, "ray", SimpleNamespace(get=lambda futures: futures))
    keys = [f"sample-{row}" for row in range(len(ROWS))]
    stored = left_right_2_no_padding(TensorDict(padded_batch(), batch_size=[len(ROWS)]))
    stored["response_mask"] = torch.nested.as_nested_tensor(
        [torch.ones(len(response), dtype=torch.long) for _, response in ROWS], layout=torch.jagged
    )
    queue.kv_batch_put(keys, "train", fields=stored.select("input_ids", "position_ids", "response_mask"))
    engine = ValueEngine(critic, use_remove_padding, dtype=dtype)

    def infer_batch(batch):
        data = queue.kv_batch_get(batch.keys, batch.partition_id, ["input_ids", "position_ids"])
        values = TensorDict({"values": engine.values(data)}, batch_size=[len(batch.keys)])
        queue.kv_batch_put(batch.keys, batch.partition_id, fields=values)
        return SimpleNamespace(futures=[])

    trainer = SimpleNamespace(config=trainer_config(truncation), critic_wg=SimpleNamespace(infer_batch=infer_batch))
    listed = ["input_ids", "position_ids", "response_mask"]
    batch = SimpleNamespace(keys=keys, partition_id="train", extra_info={}, fields=listed)
    method = trainer_base.PPOTrainer._compute_values
    method = getattr(method, ORIGINAL_ATTR) if verls else method
    assert method(trainer, batch, {}) is batch
    queue.listed = batch.fields
    return queue, keys


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["packed", "padded"])
def test_v1_trainer_stores_the_critics_value_after_the_last_token(monkeypatch, critic, use_remove_padding):
    queue, keys = v1_run(monkeypatch, critic, use_remove_padding, "bootstrap")
    verls, _ = v1_run(monkeypatch, critic, use_remove_padding, "bootstrap", verls=True)

    after_last, per_token = expected(critic)
    kept = torch.stack(queue.column(keys, VALUES_AFTER_LAST))
    torch.testing.assert_close(kept, after_last, atol=1e-5, rtol=0)
    for row, (values, verls_values) in enumerate(zip(queue.column(keys, "values"), verls.column(keys, "values"))):
        assert torch.equal(values, verls_values)  # verl's values, untouched
        torch.testing.assert_close(values, per_token[row, : len(ROWS[row][1])], atol=1e-5, rtol=0)
    assert (keys[0], VALUES_AFTER_LAST) not in verls.rows
    # listed in the batch meta, which the advantage step reads its fields by
    assert queue.listed == ["input_ids", "position_ids", "response_mask", VALUES_AFTER_LAST]
    assert verls.listed == ["input_ids", "position_ids", "response_mask"]


def test_v1_trainer_stores_it_in_the_dtype_verl_stores_values(monkeypatch, critic):
    queue, keys = v1_run(monkeypatch, critic, True, "bootstrap", dtype=torch.bfloat16)
    kept = torch.stack(queue.column(keys, VALUES_AFTER_LAST))
    assert kept.dtype == queue.column(keys, "values")[0].dtype == torch.bfloat16
    torch.testing.assert_close(kept, expected(critic)[0].to(torch.bfloat16), atol=0, rtol=0)


@pytest.mark.parametrize("truncation", [None, "terminal", "mask"])
def test_v1_trainer_without_bootstrap_is_verls_method_alone(monkeypatch, critic, truncation):
    import verl.trainer.ppo.v1.trainer_base as trainer_base

    slicing = trainer_base.response_from_nested
    queue, keys = v1_run(monkeypatch, critic, True, truncation)
    verls, _ = v1_run(monkeypatch, critic, True, truncation, verls=True)
    assert queue.rows.keys() == verls.rows.keys() and (keys[0], VALUES_AFTER_LAST) not in queue.rows
    assert all(torch.equal(queue.rows[name], verls.rows[name]) for name in queue.rows)
    assert queue.listed == verls.listed == ["input_ids", "position_ids", "response_mask"]
    assert trainer_base.response_from_nested is slicing

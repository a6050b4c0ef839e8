"""The update hook at verl's seams, in the GPU world's settings the CPU runs do not reach.

* bf16: entropy as verl's fused torch backend returns it (``torch_functional.py:127``), the critic's
  bf16 predictions and stored values, and Megatron-shaped outputs (bf16 log-probs, entropy and values,
  nested per sequence as ``postprocess_thd_engine`` returns them, the loss called by keyword as the last
  pipeline stage calls it): every column is reported in float32, equal to verl's values upcast, and
  verl's loss is unchanged.
* Which ranks report: a Ulysses rank other than 0 (verl discards its output) builds no report.
* One copy of each row: two data-parallel ranks (gloo processes) through verl's own worker, engine,
  all-gather and collect (tests/integration/update_workers.py); rows past ``max_samples_per_step`` are
  never made.

Covers: verl_ext.integration.update_hook, trace_hook.rows.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.integration.update_workers import UpdateJob, driver_keeps, run_ranks, trainer_batch

PROMPT, RESPONSE = 6, 10


def micro_batch(samples=6, dtype=torch.bfloat16, max_samples=None):
    """One micro-batch as verl's engine hands it to the loss (global batch info assigned)."""
    from verl.utils import tensordict_utils as tu

    from verl_ext.integration import trace_hook
    from verl_ext.trace.batch_keys import ROW_KEY

    data = trainer_batch(samples, PROMPT, RESPONSE, seed=3, dtype=dtype)
    data[ROW_KEY] = trace_hook.rows(samples, max_samples)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["response_mask"].sum()), global_batch_size=samples)
    return data


def nested_like(data, flat: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(flat, offsets=data["input_ids"].offsets())


def actor_config():
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1, entropy_coeff=0.01)


def critic_config():
    from verl.workers.config import FSDPCriticConfig

    return FSDPCriticConfig(strategy="fsdp2", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1)


def verl_original(function):
    from verl_ext.patching import ORIGINAL_ATTR

    return getattr(function, ORIGINAL_ATTR)


def padded(data, tensor):
    """verl's own slicing of a per-sequence output to (b, response), as its losses do."""
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(tensor, data)


def report_of(metrics) -> dict:
    from verl_ext.trace.batch_keys import PAYLOAD_KEY

    (report,) = metrics[PAYLOAD_KEY]
    return report


def assert_reported_as_float32(report: dict, name: str, expected: torch.Tensor, mask: torch.Tensor) -> None:
    column = report["columns"][name]
    assert column.dtype == np.float32, (name, column.dtype)
    np.testing.assert_array_equal(column, expected.float()[mask.bool()].numpy())  # bf16 -> float32 is exact


def fused_torch_backend_outputs(data):
    """log-probs (float32) and entropy (the model's bf16) as verl's fused torch backend computes them."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    tokens = int(data["input_ids"].offsets()[-1])
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(tokens, 16, generator=generator).to(torch.bfloat16)
    vocab = torch.randn(100, 16, generator=generator).to(torch.bfloat16)
    log_probs, entropy = FusedLinearForPPO(impl_backend="torch")(hidden, vocab, data["input_ids"].values(), temperature=1.0)
    return log_probs, entropy


def test_bf16_entropy_of_verls_fused_torch_backend_is_reported_in_float32():
    from verl.workers.utils import losses

    data = micro_batch()
    log_probs, entropy = fused_torch_backend_outputs(data)
    assert (log_probs.dtype, entropy.dtype) == (torch.float32, torch.bfloat16)  # as verl builds them
    model_output = {"log_probs": nested_like(data, log_probs), "entropy": nested_like(data, entropy)}
    loss, metrics = losses.ppo_loss(actor_config(), model_output, data)
    expected_loss, _ = verl_original(losses.ppo_loss)(actor_config(), model_output, data)
    assert torch.equal(loss, expected_loss)
    report, mask = report_of(metrics), data["response_mask"]
    assert_reported_as_float32(report, "entropy", padded(data, model_output["entropy"]), mask)
    assert_reported_as_float32(report, "log_prob", padded(data, model_output["log_probs"]), mask)
    assert len(report["columns"]["sample"]) == int(mask.sum())


def test_bf16_critic_predictions_and_stored_values_are_reported_in_float32():
    from verl.workers.utils import losses

    data = micro_batch()  # values stored in bf16, as the V1 trainer stores them
    assert data["values"].dtype == torch.bfloat16
    model_output = {"values": data["standin_values"]}  # the value head's bf16, not upcast by verl
    loss, metrics = losses.value_loss(critic_config(), model_output, data)
    expected_loss, _ = verl_original(losses.value_loss)(critic_config(), model_output, data)
    assert torch.equal(loss, expected_loss)
    report, mask, clip = report_of(metrics), data["response_mask"], critic_config().cliprange_value
    vpred, values = padded(data, model_output["values"]), data["values"]
    assert_reported_as_float32(report, "vpred", vpred, mask)
    assert_reported_as_float32(report, "value", values, mask)
    assert_reported_as_float32(report, "return", data["returns"], mask)
    assert_reported_as_float32(report, "vpred_clipped", torch.min(torch.max(vpred, values - clip), values + clip), mask)


def test_megatron_shaped_outputs_on_the_last_stage_are_reported_in_float32():
    """Megatron's last stage hands the loss bf16 outputs nested per sequence (postprocess_thd_engine),
    by keyword (transformer_impl.py:1447), the value head's output squeezed to one value per token."""
    from verl.workers.utils import losses

    data = micro_batch()
    tokens = int(data["input_ids"].offsets()[-1])
    generator = torch.Generator().manual_seed(11)
    bf16 = lambda values: nested_like(data, values.to(torch.bfloat16))  # noqa: E731
    actor_output = {"log_probs": bf16(-torch.rand(tokens, generator=generator)), "entropy": bf16(torch.rand(tokens, generator=generator))}
    critic_output = {"values": bf16(torch.randn(tokens, 1, generator=generator)).squeeze(-1)}
    _, actor_metrics = losses.ppo_loss(config=actor_config(), model_output=actor_output, data=data, dp_group=None)
    _, critic_metrics = losses.value_loss(config=critic_config(), model_output=critic_output, data=data, dp_group=None)
    mask = data["response_mask"]
    for name, key in (("log_prob", "log_probs"), ("entropy", "entropy")):
        assert_reported_as_float32(report_of(actor_metrics), name, padded(data, actor_output[key]), mask)
    ratio = report_of(actor_metrics)["columns"]["ratio"]
    assert ratio.dtype == np.float32 and np.isfinite(ratio).all()
    assert_reported_as_float32(report_of(critic_metrics), "vpred", padded(data, critic_output["values"]), mask)


def test_rows_past_max_samples_are_never_reported():
    from verl.workers.utils import losses

    from verl_ext.integration import trace_hook

    assert trace_hook.rows(5, 3).tolist() == [0, 1, 2, -1, -1] and trace_hook.rows(3).tolist() == [0, 1, 2]
    data = micro_batch(samples=6, max_samples=4)
    model_output = {"values": data["standin_values"]}
    report = report_of(losses.value_loss(critic_config(), model_output, data)[1])
    mask = data["response_mask"].bool()
    kept = mask & (torch.arange(6) < 4).unsqueeze(1)
    assert sorted(set(report["columns"]["sample"].tolist())) == [0, 1, 2, 3]
    np.testing.assert_array_equal(report["columns"]["vpred"], padded(data, model_output["values"]).float()[kept].numpy())


class _UlyssesMesh:
    """A (dp, sp) device mesh as verl's FSDP engine reads it, this process at sequence-parallel rank ``sp_rank``."""

    def __init__(self, sp_rank: int):
        self.sp_rank = sp_rank

    def __getitem__(self, name):
        return SimpleNamespace(get_local_rank=lambda: self.sp_rank if name == "sp" else 0)

    def get_group(self, mesh_dim):
        return None  # one data-parallel rank: nothing to gather


@pytest.mark.parametrize("sp_rank", [0, 1])
def test_only_the_ulysses_rank_whose_output_verl_keeps_builds_a_report(sp_rank, monkeypatch):
    """verl's FSDP engine collects only sequence-parallel rank 0 (is_mp_src_rank_with_outputs); every
    rank computes the same gathered loss, so the others build nothing (and gather nothing)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils import losses

    from tests.integration.update_workers import StandInEngine
    from verl_ext.integration import update_hook
    from verl_ext.trace import batch_keys

    built = []
    monkeypatch.setattr(update_hook, "_report", lambda *args, **kwargs: built.append(args[0]) or {"columns": {}})
    engine = StandInEngine(ulysses_device_mesh=_UlyssesMesh(sp_rank), ulysses_sequence_parallel_size=2)
    data = micro_batch()

    def verls_update(worker, batch):  # the path inside train_mini_batch: verl's iterator, then the loss
        for mini_batch in tu.make_iterator(batch, mini_batch_size=len(batch), epochs=1):
            losses.ppo_loss(actor_config(), {"log_probs": mini_batch["standin_log_probs"]}, mini_batch)
        is_collect = worker.engine.is_mp_src_rank_with_outputs()
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": {}}) if is_collect else None

    output = update_hook.traced_train_mini_batch(verls_update, SimpleNamespace(engine=engine), data)
    if sp_rank == 0:
        assert built == ["actor"] and len(tu.get(output, "metrics")[batch_keys.PAYLOAD_KEY]) == 1
    else:
        assert built == [] and output is None


def test_one_copy_of_each_row_reaches_the_driver_from_two_data_parallel_ranks():
    """Two gloo ranks through verl's worker, engine, all-gather and collect: only rank 0's output carries
    the update's rows, each (sample, token, epoch) once, from both ranks, in float32 equal to the bf16
    model outputs; rows past max_samples_per_step are not made."""
    from verl.utils import tensordict_utils as tu

    from verl_ext.trace.batch_keys import PAYLOAD_KEY

    job = UpdateJob(max_samples=12)
    outputs = run_ranks([2], job)[2]
    batch = trainer_batch(job.samples, job.prompt_length, job.response_length)  # the same seed as every rank's
    mask = batch["response_mask"].bool() & (torch.arange(job.samples) < job.max_samples).unsqueeze(1)
    expected = {(s, t, e) for s, t in zip(*map(torch.Tensor.tolist, torch.nonzero(mask, as_tuple=True))) for e in range(job.epochs)}
    for kind, column, model_output in (("actor", "entropy", "standin_entropy"), ("critic", "vpred", "standin_values")):
        rank_outputs = [answer[kind, True] for answer in outputs]
        assert PAYLOAD_KEY not in tu.get(rank_outputs[1], "metrics")
        reports = tu.get(driver_keeps(rank_outputs), "metrics")[PAYLOAD_KEY]
        rows = [
            (int(s), int(t), report["epoch"], report["rank"], float(v))
            for report in reports
            for s, t, v in zip(report["columns"]["sample"], report["columns"]["token_index"], report["columns"][column])
        ]
        keys = [(s, t, e) for s, t, e, _, _ in rows]
        assert len(keys) == len(set(keys)) and set(keys) == expected
        assert {rank for *_, rank, _ in rows} == {0, 1}
        reference = padded(batch, batch[model_output]).float()
        assert all(value == reference[s, t].item() for s, t, _, _, value in rows)

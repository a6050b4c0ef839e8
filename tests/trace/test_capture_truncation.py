"""capture.py under ``algorithm.truncation`` (docs/definitions.md#truncated-responses): the trace's
``truncated`` flag and the driver's cut are one rule; a step's Truncation is recorded as the estimate
used it (its cut, V(s_L) on the cut responses under bootstrap, the whitening statistics over the
responses not cut under mask), each against values written out by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.trace.helpers import make_capture
from verl_ext import registry
from verl_ext.trace.capture import take_snapshot
from verl_ext.trace.step_files import StepFiles, prompt_table
from verl_ext.truncation import Truncation, cut_responses

EOS = 9
#: rows: full length, not EOS (cut); full with a hole (cut); short; full ending on EOS (not cut); empty
MASK = [
    [1, 1, 1, 1, 1, 1],
    [1, 0, 0, 1, 1, 1],
    [1, 1, 1, 0, 0, 0],
    [1, 1, 1, 1, 1, 1],
    [0, 0, 0, 0, 0, 0],
]
CUT = [True, True, False, False, False]
V_L = [0.5, -1.25, 2.0, 3.0, 4.0]


def capture(truncation: Truncation | None = None):
    captured = make_capture(mask=MASK)
    captured.token_id[:, -1] = 10
    captured.token_id[3, 5] = EOS
    captured.eos_token_ids, captured.max_response_length = (EOS,), 6
    captured.truncation = truncation
    return captured


def test_the_trace_flag_and_the_drivers_cut_are_one_rule():
    captured = capture()
    flags = prompt_table(take_snapshot(captured, None))["truncated"].to_pylist()
    assert flags == CUT
    assert cut_responses(captured.token_id, captured.mask, (EOS,), 6).tolist() == CUT


@pytest.mark.parametrize("mode", ["bootstrap", "mask"])
def test_the_estimates_truncation_is_what_the_trace_records(mode):
    truncation = Truncation(mode, torch.tensor(CUT), torch.tensor(V_L) if mode == "bootstrap" else None)
    table = prompt_table(take_snapshot(capture(truncation), None))
    assert table["truncated"].to_pylist() == CUT
    expected = [0.5, -1.25, None, None, None] if mode == "bootstrap" else [None] * len(MASK)
    assert table["bootstrap_value"].to_pylist() == expected


def test_without_a_truncation_no_bootstrap_value_is_recorded():
    assert prompt_table(take_snapshot(capture(), None))["bootstrap_value"].null_count == len(MASK)


def test_the_estimates_cut_is_recorded_where_it_differs_from_the_trace_rule():
    """The column says what the estimate treated as cut, which ``check`` recomputes from."""
    table = prompt_table(take_snapshot(capture(Truncation("mask", torch.tensor([False, False, True, False, False]))), None))
    assert table["truncated"].to_pylist() == [False, False, True, False, False]


def moments(values: list[float]) -> dict[str, float]:
    n = len(values)
    mean = sum(values) / n
    return {"mean": mean, "var": sum((x - mean) ** 2 for x in values) / (n - 1)}


@pytest.mark.parametrize("mode", ["terminal", "bootstrap", "mask"])
@pytest.mark.parametrize("max_samples", [None, 2])
def test_the_whitening_statistics_are_over_the_tokens_the_estimate_whitened(mode, max_samples):
    """The estimate's statistics (registry.whitening_statistics) are over the full batch less the cut
    responses under mask; the step's entry keeps them, whatever samples the trace keeps."""
    truncation = None if mode == "terminal" else Truncation(mode, torch.tensor(CUT), torch.tensor(V_L))
    captured = capture(truncation)
    raw = captured.floats["advantage_raw"]
    rows = [b for b in range(len(MASK)) if not (mode == "mask" and CUT[b])]
    expected = moments([float(raw[b, t]) for b in rows for t in range(6) if MASK[b][t]])
    captured.whitening = registry.whitening_statistics(raw, captured.mask, truncation)
    whiten = StepFiles.build(take_snapshot(captured, max_samples)).entry.whiten
    assert whiten["mean"] == pytest.approx(expected["mean"], rel=1e-6, abs=1e-9)
    assert whiten["var"] == pytest.approx(expected["var"], rel=1e-6)


def test_every_response_masked_records_no_statistics():
    captured = capture(Truncation("mask", torch.tensor([True, True, True, True, False])))
    captured.whitening = registry.whitening_statistics(captured.floats["advantage_raw"], captured.mask, captured.truncation)
    assert captured.whitening is None and StepFiles.build(take_snapshot(captured, None)).entry.whiten is None


@pytest.mark.parametrize("field", ["cut", "bootstrap_value"])
def test_a_truncation_of_another_batch_is_refused(field):
    parts = {"cut": torch.tensor(CUT), "bootstrap_value": torch.tensor(V_L)}
    parts[field] = parts[field][:3]
    with pytest.raises(ValueError, match=rf"truncation.{field} has shape \(3,\), expected \(5,\): one per sample"):
        take_snapshot(capture(Truncation("bootstrap", **parts)), None)


def test_a_gpu_truncation_is_recorded_like_a_cpu_one():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    truncation = Truncation("bootstrap", torch.tensor(CUT).cuda(), torch.tensor(V_L).cuda())
    captured = capture(truncation)
    captured.mask = captured.mask.cuda()
    captured.floats = {name: None if t is None else t.cuda() for name, t in captured.floats.items()}
    table = prompt_table(take_snapshot(captured, None))
    assert table["bootstrap_value"].to_pylist() == [0.5, -1.25, None, None, None]
    np.testing.assert_array_equal(table["truncated"].to_pylist(), CUT)

"""capture.py: tensors -> snapshot -> Arrow tables, checked against a row-by-row reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.trace.helpers import MASK, make_capture, reference_rows
from verl_ext import registry
from verl_ext.estimators import masked_whiten
from verl_ext.trace.capture import take_snapshot
from verl_ext.trace.snapshot_memory import SnapshotMemory
from verl_ext.trace.step_files import prompt_table, token_table
from verl_ext.trace.schema import PROMPT_SCHEMA, TOKEN_SCHEMA


def without_step(table, step: int) -> list[dict]:
    """The rows of a token table, less its ``step`` column (which must be ``step`` throughout)."""
    assert table.schema.equals(TOKEN_SCHEMA, check_metadata=False)
    assert table["step"].to_pylist() == [step] * table.num_rows
    return table.drop_columns(["step"]).to_pylist()


def table_rows(capture, max_samples=None) -> list[dict]:
    return without_step(token_table(take_snapshot(capture, max_samples)), capture.step)


def test_rows_follow_the_mask_layout():
    rows = table_rows(make_capture())
    # sample 0: 3 rows; 1: 5 (the hole at 1-2 flagged); 2: none; 3: all 6; 4: 3 (up to its only token)
    assert [(r["sample"], r["token_index"], r["mask"]) for r in rows] == [
        (0, 0, True), (0, 1, True), (0, 2, True),
        (1, 0, True), (1, 1, False), (1, 2, False), (1, 3, True), (1, 4, True),
        (3, 0, True), (3, 1, True), (3, 2, True), (3, 3, True), (3, 4, True), (3, 5, True),
        (4, 0, False), (4, 1, False), (4, 2, True),
    ]  # fmt: skip


def test_a_rejected_token_is_the_policys_not_a_hole():
    """verl's rejection takes tokens out of the mask (docs/definitions.md#off-policy-tokens): they keep their
    rows, their turn and their role, and say ``rejected``. Sample 0: one rejected inside its only turn and
    its last token rejected (rows run to it); sample 1: a rejected token inside a real hole's neighbour;
    sample 2: wholly rejected (its rows are there, none valid)."""
    mask = [[1, 0, 1, 0, 0, 0], [1, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 0]]
    rejected = [[0, 1, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]]
    capture = make_capture(mask=mask, rejected=rejected)
    rows = table_rows(capture)
    assert rows == reference_rows(capture)
    by_sample = {sample: [r for r in rows if r["sample"] == sample] for sample in range(3)}
    assert [(r["mask"], r["rejected"], r["turn"], r["role"]) for r in by_sample[0]] == [
        (True, False, 0, "assistant"), (False, True, 0, "assistant"), (True, False, 0, "assistant"), (False, True, 0, "assistant"),
    ]  # fmt: skip
    assert [r["turn"] for r in by_sample[1]] == [0, 0, 0, 1, 1]  # the hole at 1–2 is a turn boundary; the rejection at 4 is not
    assert [(r["mask"], r["rejected"]) for r in by_sample[2]] == [(False, True)] * 3
    without = table_rows(make_capture(mask=mask))  # no correction: null, and the rows end at the last valid token
    assert [r["rejected"] for r in without] == [None] * 7 and len(without) == 3 + 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_values_match_the_reference_for_each_input_dtype(dtype):
    capture = make_capture(dtype=dtype)
    assert table_rows(capture) == reference_rows(capture)


def test_absent_tensors_give_null_columns():
    missing = ("value", "advantage_raw", "ref_log_prob", "kl", "token_id", "uid")
    capture = make_capture(missing=missing)
    rows = table_rows(capture)
    assert rows == reference_rows(capture)
    assert all(r["value"] is None and r["kl"] is None and r["token_id"] is None and r["uid"] is None for r in rows)
    assert all(r["advantage"] is not None for r in rows)


@pytest.mark.parametrize("max_samples", [1, 2, 4, 5, 100])
def test_max_samples_keeps_the_first_samples(max_samples):
    capture = make_capture()
    snapshot = take_snapshot(capture, max_samples)
    assert snapshot.samples == min(max_samples, len(MASK)) and snapshot.batch_samples == len(MASK)
    assert table_rows(capture, max_samples) == reference_rows(capture, max_samples)


def test_snapshot_does_not_see_later_changes_to_the_trainers_tensors():
    capture = make_capture()
    expected = reference_rows(capture)
    snapshot = take_snapshot(capture, None)
    for tensor in (capture.mask, capture.token_id, capture.prompts, capture.prompt_mask, *capture.floats.values()):
        tensor.fill_(7)
    capture.uid[:] = "changed"
    assert without_step(token_table(snapshot), 1) == expected
    assert [row["prompt_token_ids"] for row in prompt_table(snapshot).to_pylist()] != [[7] * 4] * len(MASK)


def test_mask_may_be_bool_or_float():
    as_long = make_capture()
    for dtype in (torch.bool, torch.float32):
        capture = make_capture()
        capture.mask = capture.mask.to(dtype)
        assert table_rows(capture) == reference_rows(as_long)


@settings(max_examples=60, deadline=None)
@given(
    mask=st.integers(1, 6).flatmap(
        lambda batch: st.integers(1, 9).flatmap(
            lambda length: st.lists(st.lists(st.booleans(), min_size=length, max_size=length), min_size=batch, max_size=batch)
        )
    ),
    max_samples=st.one_of(st.none(), st.integers(1, 7)),
    seed=st.integers(0, 2**16),
)
def test_any_mask_matches_the_reference(mask, max_samples, seed):
    capture = make_capture(mask=[[int(v) for v in row] for row in mask], seed=seed)
    assert table_rows(capture, max_samples) == reference_rows(capture, max_samples)


def test_prompt_table_strips_left_padding():
    capture = make_capture()
    table = prompt_table(take_snapshot(capture, 3))
    assert table.schema.equals(PROMPT_SCHEMA, check_metadata=False)
    expected = [
        {
            "step": 1,
            "sample": i,
            "uid": str(capture.uid[i]),
            "prompt_token_ids": [int(p) for p, real in zip(capture.prompts[i], capture.prompt_mask[i]) if real],
        }
        for i in range(3)
    ]
    assert table.select(["step", "sample", "uid", "prompt_token_ids"]).to_pylist() == expected
    assert all(len(row["prompt_token_ids"]) >= 1 for row in expected)


def test_prompt_table_says_how_each_response_ended():
    """MASK's rows end at positions 2, 4, (none), 5, 2 of 6; token 9 is EOS: by hand, row 0 ends with
    EOS, row 3 fills all 6 positions without EOS (truncated), the others end otherwise."""
    capture = make_capture()
    capture.token_id[0, 2] = 9
    capture.token_id[4, 2] = 9
    capture.token_id[[1, 3], [4, 5]] = 10
    capture.eos_token_ids, capture.max_response_length = (9,), 6
    rows = prompt_table(take_snapshot(capture, None)).select(["response_length", "eos", "truncated"]).to_pylist()
    assert [tuple(row.values()) for row in rows] == [
        (3, True, False), (5, False, False), (0, False, False), (6, False, True), (3, True, False),
    ]
    assert prompt_table(take_snapshot(make_capture(), None))["eos"].null_count == len(MASK)  # no EOS ids: null


def test_turns_are_counted_from_the_holes():
    """By hand from MASK: row 1 (1 0 0 1 1) has a hole before token 3, so tokens 3-4 (and the hole's
    tokens 1-2 keep turn 0) are turn 1 and the response has 2 assistant turns; row 4's masked tokens
    before its only valid token open no turn."""
    snapshot = take_snapshot(make_capture(), None)
    table = token_table(snapshot)
    by_sample = {}
    for row in table.select(["sample", "turn"]).to_pylist():
        by_sample.setdefault(row["sample"], []).append(row["turn"])
    assert by_sample == {0: [0, 0, 0], 1: [0, 0, 0, 1, 1], 3: [0] * 6, 4: [0, 0, 0]}
    assert prompt_table(snapshot)["assistant_turns"].to_pylist() == [1, 2, 0, 1, 1]
    several = make_capture(mask=[[1, 0, 1, 0, 1, 1, 0, 0, 1]])
    assert token_table(take_snapshot(several, None))["turn"].to_pylist() == [0, 0, 1, 1, 2, 2, 2, 2, 3]


def test_roles_come_from_the_mask_and_the_agent_loops_record():
    """By hand from MASK: the model's tokens are the assistant's; row 1's hole (tokens 1-2) takes its
    record's role; row 3 has no record, so its masked tokens stay unknown; row 4's record disagrees
    with its mask (it calls token 2 a tool's), so it is not used; rows without a record have no
    tool calls or turn limit."""
    import dataclasses

    records = [
        {"roles": [["assistant", 3]], "tool_calls": 0, "turn_limit": False},
        {"roles": [["assistant", 1], ["tool", 2], ["assistant", 2]], "tool_calls": 1, "turn_limit": True},
        None,
        None,
        {"roles": [["other", 2], ["tool", 1]], "tool_calls": 1, "turn_limit": False},
    ]
    capture = dataclasses.replace(make_capture(), agent_turns=records)
    snapshot = take_snapshot(capture, None)
    roles = {}
    for row in token_table(snapshot).select(["sample", "role"]).to_pylist():
        roles.setdefault(row["sample"], []).append(row["role"])
    assert roles[1] == ["assistant", "tool", "tool", "assistant", "assistant"]
    assert roles[4] == [None, None, "assistant"]
    assert table_rows(capture) == reference_rows(dataclasses.replace(capture, agent_turns=records[:4] + [None]))
    prompts = prompt_table(snapshot)
    assert prompts["tool_calls"].to_pylist() == [0, 1, None, None, None]
    assert prompts["turn_limit"].to_pylist() == [False, True, None, None, None]
    without = prompt_table(take_snapshot(make_capture(), None))  # no agent loop record at all
    assert without["tool_calls"].null_count == without["turn_limit"].null_count == len(without)


def test_prompt_table_without_mask_or_without_prompts():
    capture = make_capture()
    capture.prompt_mask = None
    rows = prompt_table(take_snapshot(capture, None)).to_pylist()
    assert [r["prompt_token_ids"] for r in rows] == capture.prompts.tolist()
    capture.prompts = None
    rows = prompt_table(take_snapshot(capture, None)).to_pylist()
    assert [r["prompt_token_ids"] for r in rows] == [None] * len(MASK)
    assert [r["sample"] for r in rows] == list(range(len(MASK)))


def numpy_whiten_stats(x: np.ndarray, valid: np.ndarray) -> tuple[float, float]:
    values = x[valid].astype(np.float64)
    n = values.size
    mean = values.sum() / n  # verl's masked_whiten with its integer mask (docs/definitions.md §6)
    return mean, ((values - mean) ** 2).sum() / (n - 1)


def test_whiten_stats_follow_masked_whiten():
    generator = torch.Generator().manual_seed(3)
    raw = 2.0 + 3.0 * torch.randn(64, 50, generator=generator)
    mask = (torch.rand(64, 50, generator=generator) > 0.4).long()
    stats = registry.whitening_statistics(raw, mask)
    mean, var = numpy_whiten_stats(raw.numpy(), mask.numpy().astype(bool))
    assert stats["mean"] == pytest.approx(mean, rel=1e-9) and stats["var"] == pytest.approx(var, rel=1e-6)
    values = raw.numpy()[mask.numpy().astype(bool)]
    assert stats["mean"] == pytest.approx(values.mean(), rel=1e-6)
    assert stats["var"] == pytest.approx(values.var(ddof=1), rel=1e-6)
    # What the record is for: the actor's whitened advantage can be rebuilt from raw and the stats.
    rebuilt = (raw - stats["mean"]) / math.sqrt(stats["var"] + 1e-8)
    valid = mask.bool()
    torch.testing.assert_close(rebuilt[valid], masked_whiten(raw, mask)[valid], rtol=1e-5, atol=1e-5)


def test_whiten_stats_cover_the_full_batch_when_samples_are_dropped():
    """The snapshot keeps the estimate's statistics (over all B rows) when it keeps fewer samples."""
    capture = make_capture()
    snapshot = take_snapshot(capture, 2)
    full = numpy_whiten_stats(capture.floats["advantage_raw"].numpy(), capture.mask.numpy().astype(bool))
    first_two = numpy_whiten_stats(capture.floats["advantage_raw"][:2].numpy(), capture.mask[:2].numpy().astype(bool))
    assert (snapshot.whiten["mean"], snapshot.whiten["var"]) == pytest.approx(full, rel=1e-6)
    assert snapshot.whiten["mean"] != pytest.approx(first_two[0], rel=1e-3)


def test_whiten_stats_undefined_cases():
    assert registry.whitening_statistics(None, torch.ones(2, 3)) is None
    assert registry.whitening_statistics(torch.ones(2, 3), torch.tensor([[0, 1, 0], [0, 0, 0]])) is None
    assert take_snapshot(make_capture(missing=("advantage_raw",)), None).whiten is None


def test_kl_coef_and_step_are_plain_numbers():
    capture = make_capture(step=7)
    capture.kl_coef = torch.tensor(0.25)
    snapshot = take_snapshot(capture, None)
    assert snapshot.step == 7 and type(snapshot.kl_coef) is float and snapshot.kl_coef == 0.25


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c.floats.update(value=torch.zeros(5, 5)), "value has shape"),
        (lambda c: c.floats.update(values=torch.zeros(5, 6)), "unknown float column"),
        (lambda c: setattr(c, "token_id", torch.zeros(4, 6)), "token_id has shape"),
        (lambda c: setattr(c, "uid", ["a"] * 4), "uid has 4 entries"),
        (lambda c: setattr(c, "prompts", torch.zeros(4, 3)), "prompts must be"),
        (lambda c: setattr(c, "prompt_mask", torch.zeros(5, 3)), "prompt_mask has shape"),
        (lambda c: setattr(c, "mask", torch.zeros(6)), "mask must be"),
        (lambda c: setattr(c, "step", -1), "step must be"),
    ],
)
def test_shape_errors_name_the_field(change, message):
    capture = make_capture()
    change(capture)
    with pytest.raises(ValueError, match=message):
        take_snapshot(capture, None)


def test_snapshot_restores_torch_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # not the one thread the snapshot runs on (the suite's default, tests/conftest.py)
    try:
        take_snapshot(make_capture(), None)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)


def test_snapshot_memory_recycles_blocks_and_drops_small_ones():
    memory = SnapshotMemory()
    first = memory.take(1000)
    memory.give_back(first)
    assert memory.take(1000) is first  # recycled
    memory.give_back(first)
    bigger = memory.take(5000)  # the free block is too small: dropped, a new one made
    assert bigger is not first and bigger.numel() >= 5000
    memory.give_back(bigger)
    assert memory.take(10) is bigger and memory.take(10) is not bigger  # nothing else was kept


def test_snapshot_in_a_dirty_recycled_block_is_exact():
    memory = SnapshotMemory()
    capture = make_capture()
    dirty = take_snapshot(make_capture(mask=[[1] * 6] * 5, seed=9), None, memory).block
    dirty.fill_(0xFF)  # NaN floats, True masks, -1 ids everywhere
    memory.give_back(dirty)
    snapshot = take_snapshot(capture, None, memory)
    assert snapshot.block is dirty
    assert without_step(token_table(snapshot), capture.step) == reference_rows(capture)
    assert prompt_table(snapshot).to_pylist() == prompt_table(take_snapshot(capture, None)).to_pylist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tensors_on_a_gpu_give_the_same_tables():
    capture = make_capture(dtype=torch.bfloat16)
    on_gpu = make_capture(dtype=torch.bfloat16)
    for field in ("mask", "token_id", "prompts", "prompt_mask"):
        setattr(on_gpu, field, getattr(on_gpu, field).cuda())
    on_gpu.floats = {name: tensor.cuda() for name, tensor in on_gpu.floats.items()}
    snapshot = take_snapshot(on_gpu, 3)
    assert without_step(token_table(snapshot), capture.step) == reference_rows(capture, 3)
    assert prompt_table(snapshot).equals(prompt_table(take_snapshot(capture, 3)))
    assert snapshot.whiten == pytest.approx(take_snapshot(capture, 3).whiten, rel=1e-6)

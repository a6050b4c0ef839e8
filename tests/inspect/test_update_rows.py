"""verl_ext.steps.update_rows: an update table's rows by (epoch, sample) and their flags, against the
rows themselves read as Python values (pyarrow's to_pylist), on a table in no particular order with
null, NaN, infinite and unknown entries."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from verl_ext.steps.update_rows import UpdateRows

ROWS = [
    # epoch, sample, token_index, clip, ratio, entropy (null everywhere: a column the run lacks)
    (1, 2, 0, "none", 1.0),
    (0, 2, 1, "high", 1.3),
    (0, 0, 0, "low", float("nan")),
    (1, 0, 1, None, 0.9),
    (0, 2, 0, "dual", None),
    (1, 2, 1, "bogus", float("inf")),
    (0, 0, 1, "none", 1.1),
    (1, 0, 0, "none", 1.0),
]


def table() -> pa.Table:
    epoch, sample, token_index, clip, ratio = zip(*ROWS)
    return pa.table({
        "sample": pa.array(sample, pa.int32()), "token_index": pa.array(token_index, pa.int32()),
        "epoch": pa.array(epoch, pa.int32()), "clip": pa.array(clip, pa.string()),
        "ratio": pa.array(ratio, pa.float32()), "entropy": pa.nulls(len(ROWS), pa.float32()),
    })  # fmt: skip


def test_rows_of_samples_in_an_epoch_keep_the_table_order_whatever_its_order():
    rows = UpdateRows(table())
    listed = table().to_pylist()
    for epoch in (0, 1):
        for samples in ([0], [2], [2, 0], [5], []):
            expected = [i for s in samples for i, row in enumerate(listed) if row["epoch"] == epoch and row["sample"] == s]
            assert rows.of(samples, epoch).tolist() == expected, (epoch, samples)
    assert rows.epochs() == [0, 1] and rows.count == len(ROWS)


def test_clipped_is_a_code_naming_a_clip_region_and_nonfinite_a_null_or_non_finite_number():
    rows = UpdateRows(table())
    listed = table().to_pylist()
    assert rows.clipped().tolist() == [row["clip"] in ("low", "high", "dual") for row in listed]
    # entropy is null everywhere: absent, so it flags nothing
    assert rows.nonfinite().tolist() == [row["ratio"] is None or not math.isfinite(row["ratio"]) for row in listed]
    critic = UpdateRows(table().drop_columns(["clip"]))
    assert not critic.clipped().any() and len(critic.clipped()) == len(ROWS)


def test_arrays_are_float64_with_nan_for_null_and_none_for_a_column_null_everywhere():
    arrays = UpdateRows(table()).arrays()
    assert arrays["entropy"] is None and arrays["ratio"].dtype == np.float64
    expected = [math.nan if row["ratio"] is None else row["ratio"] for row in table().to_pylist()]
    np.testing.assert_array_equal(arrays["ratio"], np.array(expected, np.float32).astype(np.float64))
    assert arrays["clip"].tolist() == [row[3] for row in ROWS] and arrays["sample"].tolist() == [row[1] for row in ROWS]

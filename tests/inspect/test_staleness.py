"""Staleness in summary (docs/definitions.md#policy-versions): a response's staleness is trainer_version −
policy_version_min. On synthetic format-11 traces (tests/inspect/staleness_helpers.py: a V1 separate_async
run of three verl steps of two updates each, versions and update rows drawn there), the per-step columns and
the table by staleness level, against the places written into the trace and pandas over its Parquet files;
a synchronous trace's summary is as it was (no column, no note).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tests.inspect.inspect_helpers import good_trace
from tests.inspect.staleness_helpers import PLACES, async_trace
from verl_ext.inspect.summary import SUMMARY_SCHEMA, blank_notes, summarize


def by_staleness(path):
    from verl_ext.inspect.offpolicy import by_staleness

    return by_staleness(path)


def staleness_metrics(*args):
    from verl_ext.offpolicy_metrics import staleness_metrics

    return staleness_metrics(*args)


@pytest.fixture(scope="module")
def separate_async(tmp_path_factory) -> str:
    return async_trace(tmp_path_factory.mktemp("async") / "trace")


def test_the_staleness_numbers_by_hand():
    """Trainer version 5; versions (min, max) (5, 5), (4, 5), unknown, (3, 3), −1 (unknown, as a sentinel):
    staleness 0, 1, 2 → mean 1, max 2, stale 2/3, spanned 1/3 (only (4, 5)). verl's tags are object arrays."""
    low = np.array([5, 4, None, 3, -1], dtype=object)
    high = np.array([5, 5, None, 3, 2], dtype=object)
    got = staleness_metrics(5, low, high)
    assert got == {"offpolicy/staleness_mean": 1.0, "offpolicy/staleness_max": 2.0, "offpolicy/stale_share": 2 / 3,
                   "offpolicy/spanned_share": 1 / 3}  # fmt: skip
    assert set(staleness_metrics(5, [5.0, np.nan])) == {"offpolicy/staleness_mean", "offpolicy/staleness_max", "offpolicy/stale_share"}
    assert staleness_metrics(None, low, high) == {} and staleness_metrics(5, [None, -1]) == {}


def expected_staleness(step: int) -> list[int | None]:
    _, _, version, pairs = PLACES[step]
    return [None if low is None else version - low for low, _ in pairs]


def test_summary_gives_each_steps_place_and_staleness(separate_async, run_cli):
    rows = {row["step"]: row for row in summarize(separate_async).to_pylist()}
    for step, (global_step, substep, version, pairs) in PLACES.items():
        known = [s for s in expected_staleness(step) if s is not None]
        spanned = [high > low for low, high in pairs if low is not None]
        assert (rows[step]["global_step"], rows[step]["substep"], rows[step]["trainer_version"]) == (global_step, substep, version)
        assert rows[step]["staleness_mean"] == pytest.approx(sum(known) / len(known), rel=1e-12)
        assert rows[step]["staleness_max"] == max(known)
        assert rows[step]["stale_share"] == pytest.approx(sum(s > 0 for s in known) / len(known), rel=1e-12)
        assert rows[step]["spanned_share"] == pytest.approx(sum(spanned) / len(spanned), rel=1e-12)
    assert rows[5]["staleness_mean"] == pytest.approx(0.8) and rows[6]["spanned_share"] == pytest.approx(1 / 6)  # by hand: 4/5, 1/6
    code, out, err = run_cli("summary", separate_async)
    assert code == 0 and "mode:     separate_async (parameter_sync_step=2)" in out.splitlines()[:4]
    header = next(line for line in out.splitlines() if line.startswith("step "))
    assert header.split()[-7:] == ["global_step", "substep", "trainer_version", "staleness_mean", "staleness_max", "stale_share", "spanned_share"]
    assert "staleness" not in err


def test_a_synchronous_trace_summarises_as_before(tmp_path, run_cli):
    """No staleness column (CSV keeps every column: its header is the one before), no mode line, no note;
    --by-staleness is one line, exit 2."""
    path = good_trace(tmp_path / "trace")
    table = summarize(path)
    assert table.schema.names == SUMMARY_SCHEMA.names
    code, out, err = run_cli("summary", path, "--format", "csv")
    assert code == 0 and out.splitlines()[0].split(",") == SUMMARY_SCHEMA.names
    code, out, err = run_cli("summary", path)
    assert code == 0 and "mode:" not in out and "staleness" not in out + err
    assert not any("staleness" in note for note in blank_notes(path, table))
    code, out, err = run_cli("summary", path, "--by-staleness")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "has a staleness" in err  # a format-11 trace, no mode
    sync = good_trace(tmp_path / "sync", run={"mode": {"name": "sync"}})
    assert summarize(sync).schema.names == SUMMARY_SCHEMA.names
    with_versions = async_trace(tmp_path / "versions", mode={"name": "sync"})  # a synchronous run's versions say nothing
    assert summarize(with_versions).schema.names == SUMMARY_SCHEMA.names and not by_staleness(with_versions).num_rows
    code, out, err = run_cli("summary", sync, "--by-staleness")
    assert code == 2 and "not of an asynchronous run (it records no policy versions: its mode is sync)" in err


def test_by_staleness_against_the_parquet_files(separate_async, run_cli):
    """Per (step, staleness level): responses, own tokens, the actor rows of their tokens, mean and largest
    |ratio − 1|, the share clipped, the mean weight and mean |ℓ| over their tokens; then pooled over the steps."""
    from verl_ext.trace.reader import open_trace

    trace = open_trace(separate_async)
    tokens = trace.to_pandas()
    updates = pd.concat([trace.actor_update(step).to_pandas() for step in PLACES])
    level = pd.DataFrame([(step, sample, s) for step in PLACES for sample, s in enumerate(expected_staleness(step)) if s is not None],
                         columns=["step", "sample", "staleness"])  # fmt: skip
    own = tokens[tokens["mask"] | tokens["rejected"].fillna(False).astype(bool)].merge(level, on=["step", "sample"])
    own["gap"] = (own["old_log_prob"].astype("float64") - own["rollout_log_prob"].astype("float64")).abs()
    own["weight"] = own["rollout_is_weight"].astype("float64")
    rows = updates.merge(level, on=["step", "sample"])
    rows["dev"] = (rows["ratio"].astype("float64") - 1).abs()
    rows["clipped"] = rows["clip"] != "none"
    table = by_staleness(separate_async).to_pandas()

    def compare(got, keys):
        expected = {
            "responses": level.groupby(keys).size(), "tokens": own.groupby(keys).size(), "update_rows": rows.groupby(keys).size(),
            "ratio_dev": rows.groupby(keys)["dev"].mean(), "ratio_dev_max": rows.groupby(keys)["dev"].max(),
            "clip_frac": rows.groupby(keys)["clipped"].mean(), "is_mean": own.groupby(keys)["weight"].mean(),
            "lp_gap_mean": own.groupby(keys)["gap"].mean(),
        }  # fmt: skip
        got = got.set_index(keys)
        for name, values in expected.items():
            np.testing.assert_allclose(got[name].to_numpy(float), values.reindex(got.index).to_numpy(float), rtol=1e-9, err_msg=name)
        assert list(got.index) == list(expected["responses"].index)

    compare(table[table["step"].notna()].astype({"step": int}), ["step", "staleness"])
    compare(table[table["step"].isna()].drop(columns="step"), ["staleness"])
    assert sorted(table["staleness"].unique()) == [0, 1, 2] and (table["clip_frac"] > 0).any()
    code, out, _ = run_cli("summary", separate_async, "--by-staleness", "--format", "csv")
    assert code == 0 and out.splitlines()[0] == ",".join(table.columns) and len(out.splitlines()) == len(table) + 1
    code, out, _ = run_cli("summary", separate_async, "--by-staleness")
    assert code == 0 and "over every step:" in out and "mode:     separate_async" in out


def test_a_step_without_versions_is_said(tmp_path):
    """An asynchronous run's step whose rollout said no version, and one whose trainer version is unknown."""
    places = {1: (1, None, 0, [(None, None)] * 6), 2: (2, None, None, [(1, 1)] * 6), 3: (3, None, 2, [(1, 1)] * 6)}
    path = async_trace(tmp_path / "trace", places, mode={"name": "one_step_off"}, updates=False)
    table = summarize(path)
    assert table["staleness_mean"].to_pylist() == [None, None, 1.0]
    assert blank_notes(path, table)[-2:] == [
        "staleness is blank at step 2: the trace does not say which policy version the update started from",
        "staleness is blank at step 1: no response's policy version is recorded (the rollout did not say)",
    ]


def test_show_says_where_the_step_sits_and_the_responses_versions(separate_async, tmp_path, run_cli):
    code, out, _ = run_cli("show", separate_async, "--step", "5", "--sample", "5")
    assert code == 0 and out.splitlines()[1] == (
        "versions: verl step 3, update 1 of 2, trainer version 2 · policy versions 1–2 (its generation spanned a weight update; staleness 1)"
    )
    lines = {sample: run_cli("show", separate_async, "--step", "6", "--sample", str(sample))[1].splitlines()[1] for sample in (0, 2)}
    assert lines == {0: "versions: verl step 3, update 2 of 2, trainer version 2 · policy version 1 (staleness 1)",
                     2: "versions: verl step 3, update 2 of 2, trainer version 2 · policy version 2 (staleness 0)"}  # fmt: skip
    assert run_cli("show", separate_async, "--step", "5", "--sample", "4")[1].splitlines()[1].endswith("policy version not recorded (the rollout did not say)")
    code, out, _ = run_cli("show", good_trace(tmp_path / "sync"), "--step", "1", "--sample", "0")
    assert code == 0 and "versions:" not in out and "verl step" not in out


def test_the_staleness_figure_draws_the_steps_and_the_levels(separate_async, tmp_path, run_cli):
    """Top: each step's mean and largest staleness (from the places written) and its stale share (bars);
    below, per level over every step, mean and largest |ratio − 1| and the clipped share (bars), the mean weight
    and mean |ℓ| (pandas over the Parquet files). plot writes it for this trace only: a synchronous one's
    figures are listed in test_inspect_plots.py's test_plot_command_writes_every_figure."""
    from verl_ext.errors import UsageError
    from verl_ext.inspect import plots
    from verl_ext.trace.reader import open_trace

    fig = plots.staleness_figure(separate_async)
    top, ratio, weight, share, clipped, gap = fig.axes  # the three panels, then their right-hand axes
    lines = {line.get_label(): line.get_xydata() for line in top.lines}
    steps = sorted(PLACES)
    means = [np.mean([s for s in expected_staleness(step) if s is not None]) for step in steps]
    np.testing.assert_allclose(lines["mean staleness"], np.column_stack([steps, means]), rtol=1e-12)
    np.testing.assert_allclose(lines["largest staleness"][:, 1], [0, 0, 1, 1, 2, 2])
    np.testing.assert_allclose([bar.get_height() for bar in share.patches], [0, 0, 3 / 6, 2 / 6, 3 / 5, 4 / 6], rtol=1e-12)
    trace = open_trace(separate_async)
    level = {(step, sample): s for step in PLACES for sample, s in enumerate(expected_staleness(step)) if s is not None}
    rows = pd.concat([trace.actor_update(step).to_pandas() for step in PLACES])
    rows["level"] = [level.get((step, sample)) for step, sample in zip(rows["step"], rows["sample"])]
    rows = rows[rows["level"].notna()]
    deviation = (rows["ratio"].astype(float) - 1).abs().groupby(rows["level"])
    by_line = {line.get_label(): line.get_xydata() for line in ratio.lines}
    np.testing.assert_allclose(by_line["mean |ratio − 1|"], np.column_stack([[0, 1, 2], deviation.mean()]), rtol=1e-9)
    np.testing.assert_allclose(by_line["largest |ratio − 1|"][:, 1], deviation.max(), rtol=1e-9)
    np.testing.assert_allclose([bar.get_height() for bar in clipped.patches], (rows["clip"] != "none").groupby(rows["level"]).mean(), rtol=1e-12)
    tokens = trace.to_pandas()
    tokens = tokens[tokens["mask"]]
    tokens["level"] = [level.get((step, sample)) for step, sample in zip(tokens["step"], tokens["sample"])]
    tokens = tokens[tokens["level"].notna()]
    (weights,) = weight.lines[:1]
    np.testing.assert_allclose(weights.get_ydata(), tokens["rollout_is_weight"].astype(float).groupby(tokens["level"]).mean(), rtol=1e-9)
    gaps = (tokens["old_log_prob"].astype(float) - tokens["rollout_log_prob"].astype(float)).abs().groupby(tokens["level"]).mean()
    np.testing.assert_allclose(gap.lines[0].get_ydata(), gaps, rtol=1e-9)
    counts = pd.Series(list(level.values())).value_counts().sort_index()  # responses per level over every step
    assert [t.get_text() for t in ratio.get_xticklabels()] == [f"{s}\n{n} resp." for s, n in counts.items()]
    code, out, _ = run_cli("plot", separate_async, "--out", str(tmp_path / "plots"), "-q")
    assert code == 0 and "staleness.png" in [line.rsplit("/", 1)[1] for line in out.splitlines()]
    with pytest.raises(UsageError, match="no step has a staleness"):
        plots.staleness_figure(good_trace(tmp_path / "sync"))

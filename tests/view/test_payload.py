"""verl_ext.view.payload: the page's data against the trace's Parquet files (read with pyarrow here),
and the page's schema against the records it is derived from. Arrays are decoded here from their
base64 bytes, independently of the page's script."""

from __future__ import annotations

import base64
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.support import reference
from tests.view.view_helpers import GAMMA, NAN_AT, parquet_prompts, parquet_tokens, parquet_updates
from verl_ext.errors import UsageError
from verl_ext.inspect.table import TokenDecoder
from verl_ext.trace.reader import open_trace
from verl_ext.trace.schema import CLIP_CODES, FLOAT_COLUMN_NAMES, token_file, update_file
from verl_ext.view import payload

pytestmark = pytest.mark.filterwarnings("ignore:One of rtol or atol is not valid:RuntimeWarning")  # the check of a NaN


def decoded(array: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(array["b"]), {"f4": "<f4", "i4": "<i4", "u1": "u1"}[array["t"]])


def same(shown: np.float32, value: float) -> bool:
    """The trace's float32, exactly (a NaN is the same as a NaN)."""
    return bool(shown == np.float32(value) or (np.isnan(shown) and math.isnan(value)))


@pytest.fixture(scope="module")
def source(view_trace):
    """Step NAN_AT[0] of the view trace, ids shown as #id (no tokenizer needed here)."""
    return payload.StepSource(open_trace(view_trace), NAN_AT[0], TokenDecoder())


def step_rows(trace: str, step: int) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for row in pq.read_table(f"{trace}/{token_file(step)}").to_pylist():
        out.setdefault(row["sample"], []).append(row)
    return out


# ------------------------------------------------------------------ encoding


def test_encode_keeps_the_bytes_and_clean_makes_strict_json():
    values = np.array([1.5, np.nan, -np.inf, 3.0000001], np.float32)
    assert decoded(payload.encode(values, "f4")).tobytes() == values.tobytes()
    assert decoded(payload.encode(np.array([-1, 7]), "i4")).tolist() == [-1, 7]
    assert decoded(payload.encode(np.array([True, False]), "u1")).tolist() == [1, 0]
    assert payload.clean({"a": [np.float32(0.5), float("nan")], 3: (np.int64(2), math.inf)}) == {"a": [0.5, None], "3": [2, None]}


# ------------------------------------------------------------------ the page's schema


def test_the_page_schema_comes_from_the_records(monkeypatch):
    from verl_ext.inspect import summary
    from verl_ext.trace import schema

    sent = payload.page_schema()
    assert sent["clip_codes"] == list(CLIP_CODES) and sent["float_columns"] == list(FLOAT_COLUMN_NAMES)
    # the script names no clip code and no index of its own: a colour for each code, the unclipped one, NO_CODE
    assert list(sent["clip_colours"]) == list(CLIP_CODES) and sent["clip_none"] == schema.CLIP_NONE
    assert sent["no_code"] == payload.NO_CODE and payload.NO_CODE >= len(schema.ROLE_CODES)
    # per PPO epoch: the terms of the update and the mini-batch; not the join keys nor the token table's columns
    assert sent["update_columns"] == [
        {"name": "minibatch", "kind": "int"}, {"name": "log_prob", "kind": "float"}, {"name": "ratio", "kind": "float"},
        {"name": "pg_loss", "kind": "float"}, {"name": "clip", "kind": "code"}, {"name": "entropy", "kind": "float"},
        {"name": "is_weight", "kind": "float"}, {"name": "vpred", "kind": "float"}, {"name": "vpred_clipped", "kind": "float"},
        {"name": "vf_loss", "kind": "float"}, {"name": "vf_clipped", "kind": "flag"},
    ]  # fmt: skip
    shown = [f["key"] for f in sent["summary_fields"]]
    assert shown == [name for name in summary.SUMMARY_SCHEMA.names if name not in payload.SUMMARY_NOT_SHOWN]
    assert {"samples", "tokens", "score", "explained_var", "ev_mc", "clip_low", "adv_dlogp_corr"} <= set(shown)
    quantities = {q["key"]: q for q in sent["quantities"]}
    assert quantities["ratio"]["centre"] == 1.0 and quantities["clip"]["categorical"] and "centre" not in quantities["value"]
    # a column added to an update table's record, a field to the summary's: sent with no other change
    added = schema.Column("kl_term", pa.float32(), "a new per-token term")
    monkeypatch.setattr(schema, "UPDATE_COLUMNS", {**schema.UPDATE_COLUMNS, "actor": (*schema.UPDATE_COLUMNS["actor"], added)})
    monkeypatch.setattr(summary, "SUMMARY_SCHEMA", summary.SUMMARY_SCHEMA.append(pa.field("new_field", pa.float64())))
    sent = payload.page_schema()
    assert {"name": "kl_term", "kind": "float"} in sent["update_columns"]
    assert sent["summary_fields"][-1] == {"key": "new_field", "label": "new_field", "digits": 4}


# ------------------------------------------------------------------ a step's overview


def test_the_overview_flags_each_sample_as_the_files_say(source, view_trace):
    step = NAN_AT[0]
    rows = step_rows(view_trace, step)
    prompts = {p["sample"]: p for p in parquet_prompts(view_trace, step)}
    actor = pq.read_table(f"{view_trace}/{update_file('actor', step)}").to_pylist()
    scores = {s: sum(r["score"] for r in sample_rows if r["mask"]) for s, sample_rows in rows.items()}
    overview = source.overview()
    assert [e["sample"] for e in overview["samples"]] == sorted(rows)
    assert overview["rows"] == sum(len(r) for r in rows.values()) and overview["epochs"] == [0, 1]
    for entry in overview["samples"]:
        s = entry["sample"]
        assert entry["rows"] == len(rows[s]) and entry["valid"] == sum(r["mask"] for r in rows[s])
        assert entry["score"] == pytest.approx(scores[s], rel=1e-6)
        assert entry["wrong"] == (scores[s] < max(scores.values()))
        assert entry["truncated"] == prompts[s]["truncated"] and entry["eos"] == prompts[s]["eos"]
        assert entry["uid"] == rows[s][0]["uid"]
        assert entry["clipped"] == any(u["clip"] != "none" for u in actor if u["sample"] == s)
        assert entry["nonfinite"] == (s == NAN_AT[1])
    assert any(e["wrong"] for e in overview["samples"]) and any(e["clipped"] for e in overview["samples"])
    # colour scales: the largest |x| over the valid tokens (the NaN left out), |ratio − 1| per epoch
    values = [float(np.float32(r["value"])) for rs in rows.values() for r in rs if r["mask"] and not math.isnan(r["value"])]
    assert overview["scales"]["value"] == max(abs(v) for v in values)
    ratio = [abs(np.float32(u["ratio"]) - np.float32(1)) for u in actor if u["epoch"] == 1]
    assert overview["scales"]["e1:ratio"] == pytest.approx(float(max(ratio)), rel=1e-7)


# ------------------------------------------------------------------ tokens


def test_a_chunk_holds_the_trace_numbers_and_each_epoch_joined_by_token(source, view_trace):
    step = NAN_AT[0]
    samples = [NAN_AT[1], 0]  # out of order: rows are joined by (sample, token_index), not by position
    chunk = source.chunk(samples)
    expected = [row for s in samples for row in parquet_tokens(view_trace, step, s)]
    assert chunk["samples"] == samples and chunk["starts"] == [0, len(parquet_tokens(view_trace, step, samples[0])), len(expected)]
    assert decoded(chunk["token_index"]).tolist() == [r["token_index"] for r in expected]
    assert decoded(chunk["mask"]).tolist() == [int(r["mask"]) for r in expected]
    assert chunk["pieces"] == [f"#{r['token_id']}" for r in expected]
    for name in FLOAT_COLUMN_NAMES:
        if all(r[name] is None for r in expected):  # a column the run does not have (per-turn rewards) is not sent
            assert name not in chunk["columns"]
            continue
        shown = decoded(chunk["columns"][name])
        wanted = np.array([np.nan if r[name] is None else r[name] for r in expected], np.float32)
        assert shown.tobytes() == wanted.tobytes(), name
    at = {(r["sample"], r["token_index"]): i for i, r in enumerate(expected)}
    for rows in chunk["epochs"]:
        trained = decoded(rows["trained"])
        joined = 0
        for kind in ("actor", "critic"):
            for s in samples:
                for update in parquet_updates(view_trace, kind, step, s):
                    if update["epoch"] != rows["epoch"]:
                        continue
                    i = at[(s, update["token_index"])]
                    assert trained[i] == 1
                    if kind == "actor":
                        assert CLIP_CODES[decoded(rows["columns"]["clip"])[i]] == update["clip"]
                        assert decoded(rows["columns"]["minibatch"])[i] == update["minibatch"]
                        assert same(decoded(rows["columns"]["ratio"])[i], update["ratio"])
                    else:
                        assert same(decoded(rows["columns"]["vf_loss"])[i], update["vf_loss"])
                        assert decoded(rows["columns"]["vf_clipped"])[i] == int(update["vf_clipped"])
                    joined += 1
        assert joined and trained.sum() == sum(r["mask"] for r in expected)  # every valid token, nothing else


def test_a_response_alone_has_the_estimates_of_the_whole_step(view_trace):
    """The served path estimates one response before the step's are computed: the same numbers, and
    the direct sums of tests/support/reference.py (td0's raw advantage is δ)."""
    step, sample = 3, 1
    alone = payload.StepSource(open_trace(view_trace), step, TokenDecoder()).chunk([sample])
    whole = payload.StepSource(open_trace(view_trace), step, TokenDecoder())
    whole.estimates()
    together = whole.chunk([sample])
    rows = parquet_tokens(view_trace, step, sample)
    valid = np.array([r["mask"] for r in rows])
    r = [float(np.float32(x["reward"])) for x in rows if x["mask"]]
    v = [float(np.float32(x["value"])) for x in rows if x["mask"]]
    assert set(alone["estimates"]) == set(together["estimates"]) >= {"td0", "mc"}
    for label in alone["estimates"]:
        a, b = decoded(alone["estimates"][label]), decoded(together["estimates"][label])
        assert np.isnan(a[~valid]).all() and np.isnan(b[~valid]).all()
        assert a[valid] == pytest.approx(b[valid], rel=1e-6, abs=1e-6), label
    assert decoded(alone["estimates"]["td0"])[valid] == pytest.approx(reference.deltas_row(r, v, GAMMA), rel=1e-5, abs=1e-6)


def test_an_unknown_sample_is_a_one_line_usage_error(source):
    with pytest.raises(UsageError, match=r"step 2 has no sample 42 \(traced samples: 0, 1, 2, 3, 4, 5, 6, 7\)"):
        source.chunk([42])


# ------------------------------------------------------------------ statistics


def test_statistics_compare_the_estimators_and_locate_the_failures(source, view_trace):
    import json
    from pathlib import Path

    from verl_ext.check.run import check_trace

    trace = open_trace(view_trace)
    stats = source.statistics({"step": NAN_AT[0]}, check_trace(trace, [NAN_AT[0]]))
    assert [c["key"] for c in stats["comparison_columns"]] == ["var_batch", "var_within_group", "mean_abs"]
    assert [row["estimator"] for row in stats["comparison"]] == ["mc", "td0", "nstep3", "gae0.5", "gae0.9", "gae0.95", "turn_gae"]
    recorded = json.loads(Path(view_trace, "_run.json").read_text())["steps"][str(NAN_AT[0])]["whiten"]
    assert stats["whiten"] == {"mean": recorded["mean"], "sigma": math.sqrt(recorded["var"])}
    finite = [f for f in stats["check"] if f["identity"] == "finite"]
    assert [(f["step"], f["sample"], f["token"]) for f in finite] == [NAN_AT]
    # within-group variance: each prompt's two responses form a group (uids from the prompt table)
    rows = step_rows(view_trace, 3)
    three = payload.StepSource(trace, 3, TokenDecoder()).statistics(None)
    groups: dict[str, list[float]] = {}
    for sample_rows in rows.values():
        valid = [x for x in sample_rows if x["mask"]]
        r = [float(np.float32(x["reward"])) for x in valid]
        v = [float(np.float32(x["value"])) for x in valid]
        groups.setdefault(valid[0]["uid"], []).extend(g - x for g, x in zip(reference.mc_row(r, GAMMA), v))
    expected = np.mean([np.var(values, ddof=1) for values in groups.values()])
    mc = next(row for row in three["comparison"] if row["estimator"] == "mc")
    assert len(groups) == 4 and mc["var_within_group"] == pytest.approx(expected, rel=1e-6)

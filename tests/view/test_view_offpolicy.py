"""The off-policy tokens in the browser view, in real headless chromium (docs/definitions.md#off-policy-tokens):
a token verl's rollout correction rejected is drawn as the policy's (never as a hole or a tool's
message), struck through, with what happened in its tooltip; tokens colour by the log-ratio
ℓ_t = log π_old − log π_rollout (centred at 0) and by verl's importance weight (centred at 1), the
rejected ones included; the step line shows the summary's off-policy numbers under readable labels.

The trace is tests/inspect/test_check_correction.py's: verl's own weights and rejection on random
log-probs, holes in every other response. Expected values are read from its Parquet files with pyarrow.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.inspect.test_check_correction import CASES, corrected_trace
from tests.view.test_payload import decoded
from tests.view.test_view_page import show, url
from tests.view.view_helpers import numbers_of
from verl_ext import cli
from verl_ext.trace.schema import token_file

REJECTED_TEXT = "rejected by verl's rollout correction: the policy wrote this token, nothing trained on it"
STEP = 1
#: Every token of the shown response: its attributes, classes, colour class, tooltip and computed style.
TOKENS_JS = (
    "[...document.querySelectorAll('#response .tok')].map(s => { const style = getComputedStyle(s); return {"
    " t: Number(s.dataset.t), mask: s.dataset.mask, rejected: s.dataset.rejected || null, role: s.dataset.role || null,"
    " classes: [...s.classList], colour: [...s.classList].find(c => /^(c-?\\d+|c-inf)$/.test(c)) || null, title: s.title,"
    " q: s.dataset.q, decoration: style.textDecorationLine, italic: style.fontStyle, border: style.borderTopStyle,"
    " background: style.backgroundColor }; })"
)


def corrected_page(directory, case: str) -> tuple[str, str]:
    """(the trace, its page) of a case of test_check_correction.py."""
    trace = corrected_trace(directory, CASES[case])
    out = directory / "page.html"
    assert cli.main(["view", trace, "--out", str(out), "-q"]) == 0
    return trace, str(out)


@pytest.fixture(scope="module")
def corrected(tmp_path_factory) -> tuple[str, str]:
    """Token TIS and token_k1 rejection on two steps: some tokens of every response rejected."""
    return corrected_page(tmp_path_factory.mktemp("offpolicy"), "token TIS, token_k1")


@pytest.fixture(scope="module")
def whole_responses(tmp_path_factory) -> tuple[str, str]:
    """seq_max_k2 rejection: whole responses rejected, the others kept."""
    return corrected_page(tmp_path_factory.mktemp("sequences"), "token, batch-normalised, seq_max_k2")


def rows_of(trace: str, step: int) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for row in pq.read_table(f"{trace}/{token_file(step)}").to_pylist():
        out.setdefault(row["sample"], []).append(row)
    return out


def log_ratio(row: dict) -> float:
    return float(np.float32(row["old_log_prob"])) - float(np.float32(row["rollout_log_prob"]))


def own(row: dict) -> bool:
    return bool(row["mask"] or row["rejected"])


def shade(x: float, centre: float, scale: float) -> str:
    """The colour class of x (viewer_colour.js: (x − centre)/scale in twentieths, at least one off the centre)."""
    t = (x - centre) / scale
    return "c0" if t == 0 else f"c{int(math.copysign(max(1, min(20, math.floor(abs(t) * 20 + 0.5))), t)):d}"


def sample_with_rejection_and_hole(rows: dict[int, list[dict]]) -> int:
    return next(s for s, r in rows.items() if any(x["rejected"] for x in r) and any(not own(x) for x in r[: max(i for i, x in enumerate(r) if x["mask"])]))


def test_a_rejected_token_is_the_policys_struck_through_never_a_hole(corrected, page):
    trace, out = corrected
    rows = rows_of(trace, STEP)
    sample = sample_with_rejection_and_hole(rows)  # a response with both: told apart on one page
    show(page, out, STEP, sample, colour="advantage")
    tokens = page.evaluate(TOKENS_JS)
    expected = rows[sample]
    assert [t["t"] for t in tokens] == [r["token_index"] for r in expected]
    kinds = {"rejected": 0, "hole": 0}
    for token, row in zip(tokens, expected):
        assert token["rejected"] == ("1" if row["rejected"] else "0"), row
        if row["rejected"]:
            kinds["rejected"] += 1
            assert token["mask"] == "0" and token["role"] == "assistant"
            assert "rejected" in token["classes"] and "masked" not in token["classes"] and not any(c.startswith("role-") for c in token["classes"])
            assert "line-through" in token["decoration"] and token["italic"] == "normal" and token["border"] == "dashed"
            assert token["title"] == REJECTED_TEXT
            assert token["colour"] is None  # its advantage is a masked position's: not a number to colour by
        elif not row["mask"]:  # a hole: a tool's tokens, grey, no role of the policy's
            kinds["hole"] += 1
            assert "masked" in token["classes"] and "rejected" not in token["classes"] and token["role"] is None
            assert "line-through" not in token["decoration"] and token["italic"] == "italic" and token["title"] == ""
        else:
            assert token["classes"][0] == "tok" and "rejected" not in token["classes"] and "line-through" not in token["decoration"]
            assert token["colour"] is not None
    assert kinds["rejected"] and kinds["hole"]
    # its details: what happened to it, not "masked (not trained)"
    first = next(r["token_index"] for r in expected if r["rejected"])
    page.hover(f"#response .tok[data-t='{first}']")
    page.wait("document.querySelector('#details .piece') !== null", "the details of the rejected token")
    details = page.evaluate("document.getElementById('details').textContent")
    assert REJECTED_TEXT in details and "masked (not trained)" not in details
    hole = next(r["token_index"] for r in expected if not own(r))
    page.hover(f"#response .tok[data-t='{hole}']")
    page.wait(f"document.querySelector('#details').textContent.includes('t = {hole} ')", "the details of the hole")
    assert REJECTED_TEXT not in page.evaluate("document.getElementById('details').textContent")
    head = page.evaluate("document.getElementById('sample-head').textContent")
    assert f"{kinds['rejected']} rejected by verl's rollout correction (struck through)" in head


@pytest.mark.parametrize("quantity, centre", [("log_ratio", 0.0), ("rollout_is_weight", 1.0)])
def test_tokens_colour_by_the_log_ratio_and_the_weight_rejected_ones_included(corrected, page, quantity, centre):
    """Each of the policy's tokens, valid or rejected, has the colour class of its own number over the
    step's scale (the largest |x − centre| over the step's own tokens); a hole has none."""
    trace, out = corrected
    rows = rows_of(trace, STEP)
    value = log_ratio if quantity == "log_ratio" else (lambda row: float(np.float32(row["rollout_is_weight"])))
    scale = max(abs(value(r) - centre) for rs in rows.values() for r in rs if own(r))
    sample = sample_with_rejection_and_hole(rows)
    show(page, out, STEP, sample, colour=quantity)
    assert page.evaluate("document.getElementById('response').dataset.colour") == quantity
    assert float(page.evaluate("document.getElementById('legend').dataset.scale")) == scale
    legend = page.evaluate("document.getElementById('legend').textContent")
    label = "log-ratio ℓ = log π_old − log π_rollout" if quantity == "log_ratio" else "importance weight w_t (verl's rollout_is_weight)"
    assert legend.startswith(f"{label}: ") and f"|x{' − 1' if centre else ''}|" in legend
    tokens = page.evaluate(TOKENS_JS)
    rejected_red = rejected_blue = 0
    for token, row in zip(tokens, rows[sample]):
        if not own(row):
            assert token["colour"] is None, row  # a hole: its log-probs and weight (0) are no token of the policy's
            continue
        assert token["colour"] == shade(value(row), centre, scale), (row["token_index"], value(row))
        assert float(numbers_of({"attrs": {"data-q": token["q"]}})[quantity]) == value(row)
        if row["rejected"]:
            red, _, blue = (int(x) for x in re.findall(r"\d+", token["background"])[:3])
            rejected_red += red > blue
            rejected_blue += blue > red
            assert (red > blue) == (value(row) > centre)
    assert rejected_red + rejected_blue == sum(r["rejected"] for r in rows[sample])


def test_the_rejected_filter_badge_and_the_step_line(whole_responses, page):
    trace, out = whole_responses
    rows = rows_of(trace, STEP)
    with_rejection = sorted(s for s, r in rows.items() if any(x["rejected"] for x in r))
    assert 0 < len(with_rejection) < len(rows)
    page.goto(url(out, step=STEP, filter="rejected"))
    page.wait(f"document.body.dataset.stats === '{STEP}' && location.hash.includes('filter=rejected')", "the rejected filter")
    listed = page.evaluate("[...document.querySelectorAll('#sample-list a[data-sample]')].map(a => [Number(a.dataset.sample), a.querySelector('.badge.rejected') && a.querySelector('.badge.rejected').title])")
    assert [s for s, _ in listed] == with_rejection
    assert [title for _, title in listed] == [f"{sum(x['rejected'] for x in rows[s])} token(s) rejected by verl's rollout correction" for s in with_rejection]
    # the summary's off-policy numbers, by their labels, against the Parquet file
    stats = dict(page.evaluate("[...document.querySelectorAll('#step-summary .stat')].map(s => [s.dataset.key, [s.textContent, Number(s.dataset.value)]])"))
    owned = [r for rs in rows.values() for r in rs if own(r)]
    gaps = np.array([abs(log_ratio(r)) for r in owned])
    expected = {
        "lp_gap_max": ("|ℓ| max", gaps.max()), "lp_gap_p50": ("|ℓ| p50", np.median(gaps)),
        "rejected_tokens": ("rejected token share", np.mean([r["rejected"] for r in owned])),
        "rejected_responses": ("responses with a rejection", len(with_rejection) / len(rows)),
        "is_mean": ("mean IS weight", np.mean([np.float32(r["rollout_is_weight"]) for r in owned], dtype=np.float64)),
    }  # fmt: skip
    for key, (label, value) in expected.items():
        text, shown = stats[key]
        assert shown == pytest.approx(value, rel=1e-6), key
        assert text.startswith(f"{label} "), text
    assert stats["is_ess"][0].startswith("IS ESS ") and stats["offpolicy_kl"][0].startswith("KL(rollout‖old) ")
    assert stats["rejected_tokens"][0] == f"rejected token share {expected['rejected_tokens'][1]:.3f}"


def test_the_page_data_holds_the_rejection_and_the_scales_over_the_policys_tokens(corrected):
    """The payload (no browser): the chunk's ``rejected`` is the file's, each sample's count of them, and
    the colour scales of the log-ratio and the weight over the valid and the rejected tokens."""
    from verl_ext.inspect.table import TokenDecoder
    from verl_ext.trace.reader import open_trace
    from verl_ext.view import payload

    trace, _ = corrected
    source = payload.StepSource(open_trace(trace), STEP, TokenDecoder())
    rows = rows_of(trace, STEP)
    chunk = source.chunk()
    assert decoded(chunk["rejected"]).tolist() == [int(r["rejected"]) for s in chunk["samples"] for r in rows[s]]
    overview = source.overview()
    assert {e["sample"]: e["rejected"] for e in overview["samples"]} == {s: sum(r["rejected"] for r in rs) for s, rs in rows.items()}
    owned = [r for rs in rows.values() for r in rs if own(r)]
    assert overview["scales"]["log_ratio"] == max(abs(log_ratio(r)) for r in owned)
    assert overview["scales"]["rollout_is_weight"] == max(abs(float(np.float32(r["rollout_is_weight"])) - 1) for r in owned)
    quantities = {q["key"]: q for q in payload.page_schema()["quantities"]}
    assert quantities["log_ratio"]["name"] == ["old_log_prob", "rollout_log_prob"] and "centre" not in quantities["log_ratio"]
    assert quantities["rollout_is_weight"]["centre"] == 1.0 and quantities["log_ratio"]["own"] and "own" not in quantities["advantage"]


def test_a_run_without_rollout_correction_sends_no_rejection(view_trace, page, view_page):
    """The view trace has rollout log-probs and no correction: no ``rejected`` array, no attribute on a
    token, the log-ratio still a colour, no weight."""
    from verl_ext.inspect.table import TokenDecoder
    from verl_ext.trace.reader import open_trace
    from verl_ext.view import payload

    source = payload.StepSource(open_trace(view_trace), 3, TokenDecoder())
    assert source.chunk([1])["rejected"] is None and all(e["rejected"] is None for e in source.overview()["samples"])
    show(page, view_page, 3, 1, colour="log_ratio")
    assert page.evaluate("document.querySelectorAll('#response .tok[data-rejected], #response .tok.rejected').length") == 0
    options = page.evaluate("[...document.getElementById('colour').options].map(o => o.value)")
    assert "log_ratio" in options and "rollout_is_weight" not in options

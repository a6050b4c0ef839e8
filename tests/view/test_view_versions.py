"""The policy versions of an asynchronous run in the browser view, in real headless chromium
(docs/definitions.md#policy-versions): tokens colour by their response's policy version (a colour per
version) and by its staleness (white to red over the step's largest), with a legend of the step's levels;
the step line says where the step sits in verl's loop (verl step, update of how many, trainer version) and
the step's staleness numbers; a response's head says its versions; a stale response has a badge and a
filter. A synchronous run's page has none of it.

The trace is tests/inspect/staleness_helpers.py's: a V1 separate_async run, three verl steps of two updates
each, the places and versions written there (expected values from those and the Parquet files).
"""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest

from tests.inspect.staleness_helpers import PLACES, async_trace
from tests.view.test_view_page import show, url
from tests.view.view_helpers import numbers_of
from verl_ext import cli
from verl_ext.trace.schema import token_file

#: The colours of viewer_versions.js's palette, as the browser computes them (version mod 8).
PALETTE = ["rgb(78, 121, 167)", "rgb(242, 142, 43)", "rgb(89, 161, 79)", "rgb(225, 87, 89)"]
TOKENS_JS = (
    "[...document.querySelectorAll('#response .tok')].map(s => ({ t: Number(s.dataset.t), mask: s.dataset.mask, q: s.dataset.q,"
    " colour: [...s.classList].find(c => /^(c-?\\d+|ver-\\d+)$/.test(c)) || null, background: getComputedStyle(s).backgroundColor }))"
)


@pytest.fixture(scope="module")
def async_page(tmp_path_factory) -> tuple[str, str]:
    directory = tmp_path_factory.mktemp("async")
    trace = async_trace(directory / "trace")
    out = directory / "page.html"
    assert cli.main(["view", trace, "--out", str(out), "-q"]) == 0
    return trace, str(out)


def rows_of(trace: str, step: int, sample: int) -> list[dict]:
    return [row for row in pq.read_table(f"{trace}/{token_file(step)}").to_pylist() if row["sample"] == sample]


def shade(t: float) -> str:
    """viewer_colour.js's class of t in [0, 1]: twentieths, at least one off 0."""
    return "c0" if t == 0 else f"c{int(math.copysign(max(1, min(20, math.floor(abs(t) * 20 + 0.5))), t))}"


@pytest.mark.parametrize("step, sample", [(5, 5), (6, 3), (5, 2), (3, 0)])
def test_tokens_colour_by_their_responses_policy_version(async_page, page, step, sample):
    trace, out = async_page
    _, _, trainer, pairs = PLACES[step]
    version = pairs[sample][0]
    show(page, out, step, sample, colour="policy_version")
    assert page.evaluate("document.getElementById('response').dataset.colour") == "policy_version"
    tokens = page.evaluate(TOKENS_JS)
    for token, row in zip(tokens, rows_of(trace, step, sample), strict=True):
        if row["mask"]:
            assert token["colour"] == f"ver-{version}" and token["background"] == PALETTE[version], row["token_index"]
            assert float(numbers_of({"attrs": {"data-q": token["q"]}})["policy_version"]) == version
        else:  # a hole: no token of the policy's, no version
            assert token["colour"] is None and "policy_version=" not in token["q"]
    legend = page.evaluate("[...document.querySelectorAll('#legend .swatch')].map(s => [Number(s.dataset.level), getComputedStyle(s).backgroundColor])")
    versions = sorted({low for low, _ in pairs if low is not None})
    assert legend == [[v, PALETTE[v]] for v in versions]
    text = page.evaluate("document.getElementById('legend').textContent")
    assert text.startswith("policy version (of the weights that generated the response):") and f"trainer version {trainer}" in text


def test_tokens_colour_by_staleness_white_to_red(async_page, page):
    trace, out = async_page
    step = 6
    _, _, trainer, pairs = PLACES[step]
    staleness = [None if low is None else trainer - low for low, _ in pairs]
    most = max(s for s in staleness if s is not None)
    for sample in (0, 2, 3):  # staleness 1, 0, 2
        show(page, out, step, sample, colour="staleness")
        tokens = page.evaluate(TOKENS_JS)
        valid = [t for t, row in zip(tokens, rows_of(trace, step, sample)) if row["mask"]]
        assert valid and {t["colour"] for t in valid} == {shade(staleness[sample] / most)}
        red, green, blue = (int(x) for x in valid[0]["background"][4:-1].split(","))
        assert (red, green, blue) == (255, 255, 255) if staleness[sample] == 0 else red > green and red > blue
    swatches = page.evaluate("[...document.querySelectorAll('#legend .swatch')].map(s => Number(s.dataset.level))")
    assert swatches == sorted({s for s in staleness if s is not None})


def test_the_step_line_the_head_the_badge_and_the_filter_and_none_of_it_on_a_synchronous_run(async_page, page, view_trace, view_page):
    """The step's place and staleness numbers, a response's versions, the stale badges and filter; and the view
    trace's page (no mode, no versions): no version quantity, no place, no versions in the head, no badge."""
    from verl_ext.inspect.table import TokenDecoder
    from verl_ext.trace.reader import open_trace
    from verl_ext.view import payload

    trace, out = async_page
    step = 5
    show(page, out, step, 5)
    page.wait(f"document.body.dataset.stats === '{step}'", "the step's statistics")
    line = page.evaluate("document.getElementById('step-summary').textContent")
    assert line.startswith("step 5 · verl step 3, update 1 of 2, trainer version 2 · samples ")
    stats = dict(page.evaluate("[...document.querySelectorAll('#step-summary .stat')].map(s => [s.dataset.key, [s.textContent, Number(s.dataset.value)]])"))
    known = [2 - low for low, _ in PLACES[step][3] if low is not None]
    assert stats["staleness_mean"] == ["mean staleness " + f"{sum(known) / len(known):.3f}", pytest.approx(sum(known) / len(known))]
    assert stats["staleness_max"][1] == max(known) and stats["stale_share"][1] == pytest.approx(sum(s > 0 for s in known) / len(known))
    head = page.evaluate("document.getElementById('sample-head').textContent")
    assert "policy versions 1–2 (its generation spanned a weight update; staleness 1)" in head
    assert "separate_async (parameter_sync_step=2)" in page.evaluate("document.getElementById('run-line').textContent")
    page.goto(url(out, step=step, filter="stale"))
    page.wait(f"document.body.dataset.stats === '{step}' && location.hash.includes('filter=stale')", "the stale filter")
    listed = page.evaluate("[...document.querySelectorAll('#sample-list a[data-sample]')].map(a => [Number(a.dataset.sample), a.querySelector('.badge.stale') && a.querySelector('.badge.stale').textContent])")
    assert listed == [[sample, f"s{2 - low}"] for sample, (low, _) in enumerate(PLACES[step][3]) if low is not None and 2 - low > 0]
    source = payload.StepSource(open_trace(view_trace), 2, TokenDecoder())
    overview, chunk = source.overview(), source.chunk([0])
    assert "place" not in overview and "levels" not in overview and "staleness" not in overview["samples"][0]
    assert not {"policy_version", "staleness"} & set(chunk["columns"]) and "mode" not in payload.run_info(open_trace(view_trace), TokenDecoder())
    show(page, view_page, 2, 0)
    page.wait("document.body.dataset.stats === '2'", "the step's statistics")
    options = page.evaluate("[...document.getElementById('colour').options].map(o => o.value)")
    assert "policy_version" not in options and "staleness" not in options
    assert "verl step" not in page.evaluate("document.getElementById('step-summary').textContent")
    assert "policy version" not in page.evaluate("document.getElementById('sample-head').textContent")
    assert page.evaluate("document.querySelectorAll('.badge.stale, #step-summary .stat[data-key^=stale]').length") == 0

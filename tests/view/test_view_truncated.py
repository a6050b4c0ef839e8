"""The end of a cut response in the browser view, in real headless chromium
(docs/definitions.md#truncated-responses): a marker on its last valid token, with a tooltip that gives
V(s_L) where the run recorded it. Which responses were cut, and where they end, is read from the
trace's Parquet files with pyarrow."""

from __future__ import annotations

import numpy as np
import pytest

from tests.view.test_view_page import show
from tests.view.view_helpers import parquet_prompts, parquet_tokens

#: What every marked token's tooltip begins with.
CUT_TEXT = "cut at the length limit after this token: the response did not end."


def marked(page) -> list[dict]:
    return page.evaluate(
        "[...document.querySelectorAll('#response .tok.cut-end')].map(s => ({t: Number(s.dataset.t), title: s.title,"
        " after: getComputedStyle(s, '::after').content, value: s.dataset.bootstrapValue || null}))"
    )


def test_the_last_token_of_a_cut_response_is_marked_and_no_other(view_page, view_trace, page):
    step = 2
    prompts = parquet_prompts(view_trace, step)
    cut = [row["sample"] for row in prompts if row["truncated"]]
    ended = [row["sample"] for row in prompts if row["truncated"] is False]
    assert cut and ended  # the trace has both kinds
    for sample in (cut[0], ended[0]):
        show(page, view_page, step, sample)
        last = max(row["token_index"] for row in parquet_tokens(view_trace, step, sample) if row["mask"])
        shown = marked(page)
        if sample in ended:
            assert shown == [], sample
            continue
        assert [m["t"] for m in shown] == [last]
        # this run did not bootstrap: no V(s_L) recorded, and the tooltip says so
        assert shown[0]["title"] == f"{CUT_TEXT} V(s_L) not recorded (the run did not bootstrap)"
        assert shown[0]["after"] == '"»"' and shown[0]["value"] is None
        page.hover(f"#response .tok[data-t='{last}']")
        page.wait("document.querySelector('#details .cut-note') !== null", "the cut note of the hovered token")
        assert page.evaluate("document.querySelector('#details .cut-note').textContent") == shown[0]["title"]


def test_a_bootstrap_run_shows_v_after_the_cut_and_re_estimates_with_it(tmp_path, page):
    """The cut response of tests/inspect/test_inspect_truncated.py (γ = 0.9, λ = 0.5) from a run that
    bootstrapped from V(s_L) = 0.8: the tooltip gives it, and the page's re-estimated raw advantages
    are that file's hand-calculated bootstrap ones (the uncut responses' are the terminal ones)."""
    from tests.inspect.test_inspect_truncated import BOOTSTRAP_CUT, TERMINAL, TOL, write
    from verl_ext import cli
    from verl_ext.inspect.table import TokenDecoder
    from verl_ext.trace.reader import open_trace
    from verl_ext.view import payload

    trace = write(tmp_path / "trace", bootstrap=True)
    raw, notes = payload.StepSource(open_trace(trace), 1, TokenDecoder()).estimates()
    assert notes == [] and np.allclose(raw["gae0.5"], [*BOOTSTRAP_CUT, *TERMINAL[3:]], atol=TOL)
    out = tmp_path / "page.html"
    assert cli.main(["view", trace, "--out", str(out), "-q"]) == 0
    show(page, str(out), 1, 0)
    shown = marked(page)
    assert [m["t"] for m in shown] == [2]
    assert shown[0]["title"] == f"{CUT_TEXT} V(s_L) = 0.8000, the critic's value after it (bootstrap adds γ·V(s_L) to this token's reward)"
    assert float(shown[0]["value"]) == pytest.approx(0.8, abs=TOL)
    show(page, str(out), 1, 2)  # ended on EOS at the limit: no marker
    assert marked(page) == []

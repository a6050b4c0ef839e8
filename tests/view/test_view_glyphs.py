"""The page in a real headless chromium whose only font has no CJK glyphs (fontconfig limited to
matplotlib's DejaVu Sans): it says once that CJK text is drawn as empty boxes and what to install;
with a CJK font (a generated one, given to the page as a FontFace) it says nothing. And the
estimator table's headers stand over their numbers."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import matplotlib
import pytest

from tests.view import chromium
from tests.view.conftest import START
from tests.view.view_helpers import PIECES

#: The trace's CJK characters (its pieces and prompts hold 等于, 是, 的).
HAN = sorted({c for piece in PIECES for c in piece if "\u4e00" <= c <= "\u9fff"})
NOTE = "#notes #glyph-note"


def han_font() -> bytes:
    """A TrueType font whose every HAN character is a filled square (no missing-glyph box)."""
    import io

    from fontTools.fontBuilder import FontBuilder
    from fontTools.pens.ttGlyphPen import TTGlyphPen

    def square(empty: bool = False):
        pen = TTGlyphPen(None)
        if not empty:
            pen.moveTo((100, -100)), pen.lineTo((100, 800)), pen.lineTo((900, 800)), pen.lineTo((900, -100)), pen.closePath()
        return pen.glyph()

    names = [".notdef", *(f"uni{ord(c):04X}" for c in HAN)]
    builder = FontBuilder(1000, isTTF=True)
    builder.setupGlyphOrder(names)
    builder.setupCharacterMap({ord(c): f"uni{ord(c):04X}" for c in HAN})
    builder.setupGlyf({name: square(empty=name == ".notdef") for name in names})
    builder.setupHorizontalMetrics({name: (1000, 100) for name in names})
    builder.setupHorizontalHeader(ascent=880, descent=-120)
    builder.setupNameTable({"familyName": "Test Han", "styleName": "Regular"})
    builder.setupOS2(sTypoAscender=880, sTypoDescender=-120, usWinAscent=880, usWinDescent=120)
    builder.setupPost()
    out = io.BytesIO()
    builder.save(out)
    return out.getvalue()


@pytest.fixture(scope="module")
def latin_only(tmp_path_factory):
    """A chromium that finds no font but DejaVu Sans (its fontconfig is read at start)."""
    home = tmp_path_factory.mktemp("fonts")
    fonts = Path(matplotlib.get_data_path()) / "fonts" / "ttf"
    (home / "fonts.conf").write_text(
        f'<?xml version="1.0"?>\n<fontconfig><dir>{fonts}</dir><cachedir>{home / "cache"}</cachedir>'
        "<selectfont><acceptfont><glob>*/DejaVuSans.ttf</glob></acceptfont><rejectfont><glob>*</glob></rejectfont></selectfont></fontconfig>\n"
    )
    try:
        instance = chromium.Browser(env={"FONTCONFIG_FILE": str(home / "fonts.conf")})
    except chromium.ChromiumMissing as error:
        pytest.fail(str(error), pytrace=False)
    yield instance
    instance.close()


def open_view(browser, path: str, step: int, sample: int, before_load: str | None = None):
    tab = browser.page()
    if before_load:
        tab.send("Page.addScriptToEvaluateOnNewDocument", {"source": before_load})
    tab.goto(f"file://{path}#step={step}&sample={sample}")
    tab.wait_rendered(step, sample)
    tab.wait("document.body.dataset.glyphless !== undefined", "the page's look at its glyphs")
    return tab


def notes(tab) -> list[str]:
    return tab.evaluate("[...document.querySelectorAll('#notes .note')].map(n => n.textContent)")


def test_cjk_without_a_font_is_named_once_with_what_to_install(latin_only, view_page):
    tab = open_view(latin_only, view_page, *START)
    try:
        assert sorted(tab.evaluate("document.body.dataset.glyphless")) == HAN
        tab.wait(f"!!document.querySelector({json.dumps(NOTE)})", "the note on missing glyphs")
        shown = [text for text in notes(tab) if "font" in text]
        assert len(shown) == 1 and "fonts-noto-cjk" in shown[0] and "empty boxes" in shown[0]
        assert all(c in shown[0] for c in HAN)
        box = tab.evaluate(f"(() => {{ const r = document.querySelector({json.dumps(NOTE)}).getBoundingClientRect(); return [r.width, r.height, r.top]; }})()")
        assert box[0] > 0 and box[1] > 0 and box[2] < 400  # visible, in the header
        # another response, another step: still the one note
        for step, sample in ((START[0], 1), (3, 2)):
            tab.goto(f"file://{view_page}#step={step}&sample={sample}")
            tab.wait_rendered(step, sample)
            assert [text for text in notes(tab) if "font" in text] == shown
    finally:
        tab.close()


def test_cjk_with_a_font_draws_and_says_nothing(latin_only, view_page):
    font = base64.b64encode(han_font()).decode("ascii")
    given = (
        f"document.fonts.add(new FontFace('Noto Sans CJK SC', Uint8Array.from(atob('{font}'), (c) => c.charCodeAt(0))));"
    )
    tab = open_view(latin_only, view_page, *START, before_load=given)
    try:
        assert tab.evaluate("document.body.dataset.glyphless") == ""
        assert tab.evaluate(f"document.querySelector({json.dumps(NOTE)})") is None
        assert not [text for text in notes(tab) if "font" in text]
    finally:
        tab.close()


def test_the_estimator_headers_stand_over_their_numbers(view_page, page):
    step = 3
    page.goto(f"file://{view_page}#step={step}&sample=0")
    page.wait_rendered(step, 0)
    edges = page.evaluate(
        "(() => { const table = document.getElementById('compare-table'); const rows = [...table.rows];"
        " const text = (cell) => { const range = document.createRange(); range.selectNodeContents(cell);"
        " const r = range.getBoundingClientRect(); return [r.left, r.right]; };"
        " return rows[0].cells.length && [...rows[0].cells].map((th, i) => [text(th), ...rows.slice(1).map((tr) => text(tr.cells[i]))]); })()"
    )
    assert len(edges) == 4  # the estimator, then the three statistics
    names = edges[0]
    assert max(left for left, _ in names) - min(left for left, _ in names) < 0.5  # names and their header: left
    for column in edges[1:]:
        rights = [right for _, right in column]
        assert max(rights) - min(rights) < 0.5, column  # each statistic and its header: right
        assert len({round(left) for left, _ in column}) > 1  # numbers of different widths: not centred nor left by chance

"""Fixtures of the browser tests: one chromium for the whole session, the synthetic traces and pages
built once. Without chromium these tests fail with how to install it; they never skip."""

from __future__ import annotations

import pytest

from tests.view import chromium
from tests.view.view_helpers import B, NAN_AT, parquet_tokens, save_piece_tokenizer, write_view_trace
from verl_ext import cli


@pytest.fixture(scope="session")
def browser():
    try:
        instance = chromium.Browser()
    except chromium.ChromiumMissing as error:
        pytest.fail(str(error), pytrace=False)
    yield instance
    instance.close()


@pytest.fixture
def page(browser):
    tab = browser.page()
    yield tab
    tab.close()


@pytest.fixture(scope="session")
def piece_tokenizer(tmp_path_factory) -> str:
    return save_piece_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def view_trace(tmp_path_factory, piece_tokenizer) -> str:
    """Three steps, update tables, a NaN value planted at NAN_AT (the check fails there)."""
    return write_view_trace(tmp_path_factory.mktemp("view") / "trace", piece_tokenizer)


@pytest.fixture(scope="session")
def clean_trace(tmp_path_factory, piece_tokenizer) -> str:
    """The same without the NaN: every identity of the check holds."""
    return write_view_trace(tmp_path_factory.mktemp("clean") / "trace", piece_tokenizer, planted=False)


#: The response shown first by the page of ``view_trace``: step 2, sample 0 (full length, truncated).
START = (2, 0)


@pytest.fixture(scope="session")
def view_page(tmp_path_factory, view_trace) -> str:
    """The page of ``view_trace`` written by the command line, starting at START."""
    out = tmp_path_factory.mktemp("page") / "run.html"
    code = cli.main(["view", view_trace, "--out", str(out), "--step", str(START[0]), "--sample", str(START[1]), "-q"])
    assert code == 0
    return str(out)


@pytest.fixture(scope="session")
def long_samples(view_trace) -> list[int]:
    """Samples of step 2 other than the planted one, longest first."""
    lengths = {s: len(parquet_tokens(view_trace, 2, s)) for s in range(B) if s != NAN_AT[1]}
    return sorted(lengths, key=lambda s: -lengths[s])

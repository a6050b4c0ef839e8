from pathlib import Path

import pytest

from tests.inspect.inspect_helpers import good_trace, save_char_tokenizer


@pytest.fixture(scope="session")
def char_tokenizer(tmp_path_factory) -> str:
    """A character-level tokenizer directory (each character of the seed example is one token)."""
    return save_char_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def trace(tmp_path) -> Path:
    """A small trace that passes the checker (:func:`good_trace`), written by the real TraceWriter."""
    return Path(good_trace(tmp_path / "trace"))

import pytest

from tests.inspect.inspect_helpers import save_char_tokenizer


@pytest.fixture(scope="session")
def char_tokenizer(tmp_path_factory) -> str:
    """A character-level tokenizer directory (each character of the seed example is one token)."""
    return save_char_tokenizer(tmp_path_factory.mktemp("tokenizer"))

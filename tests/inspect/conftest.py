from unittest import mock

import pytest
from tests.inspect.inspect_helpers import save_char_tokenizer

from verl_ext import cli


@pytest.fixture(scope="session")
def char_tokenizer(tmp_path_factory) -> str:
    """A character-level tokenizer directory (each character of the seed example is one token)."""
    return save_char_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def run_cli(capsys):
    """``verl-ext SUBCOMMAND ...`` through the real dispatcher (only that subcommand registered);
    returns (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        with mock.patch.dict(cli.SUBCOMMANDS, {argv[0]: cli.SUBCOMMANDS[argv[0]]}, clear=True):
            code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run

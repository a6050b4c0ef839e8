"""Fixtures shared by the whole test tree."""

from __future__ import annotations

from unittest import mock

import pytest

from verl_ext import cli


@pytest.fixture
def run_cli(capsys):
    """``verl-ext SUBCOMMAND ...`` through the real dispatcher (only that subcommand registered);
    returns (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        with mock.patch.dict(cli.COMMANDS, {argv[0]: cli.COMMANDS[argv[0]]}, clear=True):
            code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run

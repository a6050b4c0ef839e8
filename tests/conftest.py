"""Fixtures shared by the whole test tree."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from unittest import mock

import pytest

from tests.cpu import helpers
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


# --------------------------------------------------------------------------- the CPU backend, its task and apps

#: Tests that run the CPU backend (directly or through the task and the apps).
CPU_TESTS = tuple(Path(__file__).parent / name for name in ("cpu", "tasks", "apps"))


def pytest_collection_modifyitems(config, items):
    """On a host with a CUDA GPU the CPU backend refuses to activate: skip its tests there."""
    import torch

    if torch.cuda.is_available():
        skip = pytest.mark.skip(reason="verl-ext's CPU backend refuses to run on a host with a CUDA GPU")
        for item in items:
            if any(directory in Path(item.fspath).parents for directory in CPU_TESTS):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def assets_dir() -> Path:
    """The asset cache every test and ``make demo`` share (``$VERL_EXT_CPU_ASSETS``, else
    ``~/.cache/verl_ext/cpu_assets``): building the assets takes about a minute, so the suite
    builds them at most once (the cache is keyed by everything that determines them)."""
    from verl_ext.tasks.arith.assets import default_cache_dir

    return default_cache_dir()


@pytest.fixture(scope="session")
def assets(assets_dir):
    from verl_ext.tasks.arith.assets import build_assets

    return build_assets(assets_dir)


@pytest.fixture(scope="session")
def cpu_env(assets_dir):
    """The environment of a CPU run writing into ``output_dir``."""

    def make(output_dir: Path) -> dict[str, str]:
        from verl_ext.cpu.overrides import cpu_environment

        return {**os.environ, **cpu_environment(output_dir), "VERL_EXT_CPU_ASSETS": str(assets_dir)}

    return make


@pytest.fixture(scope="session")
def scenario(cpu_env, assets):
    """Run ``scenarios.py <name> <output_dir> [args]`` in a fresh interpreter; return the output dir."""

    def run_scenario(name: str, output_dir: Path, *args: str, timeout: int = 240) -> Path:
        output_dir.mkdir(parents=True, exist_ok=True)
        helpers.run([sys.executable, str(helpers.SCENARIOS), name, str(output_dir), *args], cpu_env(output_dir), output_dir, timeout)
        return output_dir

    return run_scenario


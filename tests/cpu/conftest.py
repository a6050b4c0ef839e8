"""Fixtures of the CPU-backend tests. Scenarios that touch verl run in a fresh interpreter each."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.cpu.helpers import SCENARIOS, run

CPU_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    """On a host with a CUDA GPU the CPU backend refuses to activate: skip its tests there."""
    import torch

    if torch.cuda.is_available():
        skip = pytest.mark.skip(reason="verl-ext's CPU backend refuses to run on a host with a CUDA GPU")
        for item in items:
            if CPU_TESTS in Path(item.fspath).parents:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def assets_dir() -> Path:
    """The asset cache every test and ``make demo`` share (``$VERL_EXT_CPU_ASSETS``, else
    ``~/.cache/verl_ext/cpu_assets``): building the assets takes about a minute, so the suite
    builds them at most once (the cache is keyed by everything that determines them)."""
    from verl_ext.cpu.assets import default_cache_dir

    return default_cache_dir()


@pytest.fixture(scope="session")
def assets(assets_dir):
    from verl_ext.cpu.assets import build_assets

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
        run([sys.executable, str(SCENARIOS), name, str(output_dir), *args], cpu_env(output_dir), output_dir, timeout)
        return output_dir

    return run_scenario


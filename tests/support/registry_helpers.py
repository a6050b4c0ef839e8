"""A registry of this test's own: estimators a test registers are gone after it (the registry is
process-global, and other tests list its names)."""

from __future__ import annotations

import pytest


@pytest.fixture
def isolated_registry(monkeypatch):
    """verl_ext.registry with copies of its tables and no listeners (nothing reaches verl's registry)."""
    # verl's registry first: where core_algos were first imported inside the test, the plugin's touch would
    # copy the isolated table, the test's estimators included, into verl's for the rest of the process
    import verl.trainer.ppo.core_algos  # noqa: F401

    from verl_ext import registry

    monkeypatch.setattr(registry, "_ESTIMATORS", dict(registry._ESTIMATORS))
    monkeypatch.setattr(registry, "_LISTENERS", [])
    return registry

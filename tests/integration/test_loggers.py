"""verl's loggers made in a ``fit()`` are finished when it ends (verl_ext.integration.loggers), in-process:
the plugin's real fit wrapper of the legacy trainer around a stand-in for verl's ``RayPPOTrainer.fit`` that
makes verl's own ``Tracking`` as verl's does, in a local that a reference cycle keeps alive. A W&B run of
verl's trainer on Ray, read back with W&B's own reader: tests/e2e/test_selftest.py."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest


def traced_logger_fit(made: list, fail: bool):
    """verl's ``RayPPOTrainer.fit`` as far as its logger goes: ``Tracking`` in a local, a step logged, and a
    ``config.get`` of a key the struct config lacks (verl's fit makes several), whose exception omegaconf
    catches inside: its traceback's frames form a cycle that holds this frame, and with it the logger."""

    def fit(trainer):
        from verl.utils.tracking import Tracking

        logger = Tracking(project_name="verl_ext_test", experiment_name="loggers", default_backend=["file"])
        made.append(weakref.ref(logger))
        logger.logger["wandb"] = trainer.wandb  # a stand-in for the wandb module: what finish() tells it
        trainer.config.trainer.get("a_key_verl_lacks", None)
        logger.log(data={"verl_ext/critic/ev_mc": 0.5}, step=1)
        if fail:
            raise RuntimeError("a step failed")

    return fit


@pytest.mark.parametrize(("fail", "exit_code"), [(False, 0), (True, 1)])
def test_verls_logger_made_in_fit_is_finished_when_fit_ends(compose, tmp_path, monkeypatch, fail, exit_code):
    """Issue 59: verl's legacy fit() never finishes its logger, and the cycle kept it until the process'
    exit, after W&B's service had gone. The collector is off here, as nothing collects on a Ray TaskRunner
    idle after fit(): the logger is still alive after fit() ended (the cycle is real), and finished."""
    from verl_ext.integration import patches

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    made, told = [], []
    wandb = SimpleNamespace(log=lambda data, step: None, finish=lambda exit_code: told.append(exit_code))
    trainer = SimpleNamespace(config=compose(), wandb=wandb)
    gc.collect()
    gc.disable()
    try:
        if fail:
            with pytest.raises(RuntimeError, match="a step failed"):
                patches.wrap_legacy_fit(traced_logger_fit(made, fail))(trainer)
        else:
            patches.wrap_legacy_fit(traced_logger_fit(made, fail))(trainer)
        tracking = made[0]()
        assert tracking is not None  # held by the cycle, as verl's is
        assert tracking.logger["file"].fp.closed and told == [exit_code]
        assert (tmp_path / "metrics.jsonl").read_text().count('"verl_ext/critic/ev_mc":0.5') == 1
    finally:
        gc.enable()
    tracking.finish()  # as Tracking.__del__ does later: a second finish is verl's no-op
    assert told == [exit_code]


def test_a_logger_made_outside_fit_is_verls_alone(tmp_path, monkeypatch):
    from verl.utils.tracking import Tracking

    from verl_ext.integration import loggers

    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "metrics.jsonl"))
    with loggers.finished_when_fit_ends() as made:
        pass
    outside = Tracking(project_name="verl_ext_test", experiment_name="outside", default_backend=["file"])
    assert made == [] and not outside.logger["file"].fp.closed
    outside.finish()

"""`verl-ext doctor` reports a healthy installation, and notices a plugin verl does not load."""

from __future__ import annotations

import os
import subprocess
import sys

from packaging.version import Version

from tests.integration.conftest import verl_version


def doctor(env_extra: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "verl_ext.cli", "doctor"],
        capture_output=True, text=True, env={**os.environ, **(env_extra or {})}, timeout=300,
    )  # fmt: skip


def test_doctor_on_this_installation():
    # verl < 0.9 loads plugins only through VERL_USE_EXTERNAL_MODULES (the documented way there)
    result = doctor({} if verl_version() >= Version("0.9.0") else {"VERL_USE_EXTERNAL_MODULES": "verl_ext"})
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    assert lines[-1].endswith(" ok, 0 broken")
    for expected in (
        "verl.trainer.ppo.ray_trainer.compute_advantage",
        "verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_advantage",
        "mc: registered",
        "gae_ext: registered",
        "critic.enable=null switches the critic on for: mc, td0, nstep, gae_ext",
        "fresh import verl  plugin loaded",
    ):
        assert any(expected in line for line in lines), expected


def test_doctor_notices_that_a_fresh_import_verl_does_not_load_the_plugin():
    result = doctor({"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": ""})
    assert result.returncode == 1
    assert any(line.startswith("BAD  fresh import verl  plugin absent") for line in result.stdout.splitlines())

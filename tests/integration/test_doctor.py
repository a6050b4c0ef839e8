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
    plugins = {} if verl_version() >= Version("0.9.0") else {"VERL_USE_EXTERNAL_MODULES": "verl_ext"}
    result = doctor({**plugins, "VERL_EXT_CPU": ""})  # the backend's switch off, as the lines below say
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
    import torch

    gpu = next(line for line in lines if line.startswith("ok   gpu "))
    cpu_backend = next(line for line in lines if line.startswith("ok   cpu backend "))
    if not torch.cuda.is_available():  # this machine as torch sees it, asked here
        assert gpu.endswith("none: torch sees no CUDA device, so verl's own trainer cannot run here")
        assert cpu_backend.endswith("off (VERL_EXT_CPU=''): training on this machine needs it, VERL_EXT_CPU=1")
    else:
        assert f"{torch.cuda.device_count()} CUDA device(s): " in gpu and cpu_backend.endswith("off (VERL_EXT_CPU='')")
    # verl's import-time warnings (no accelerator, optional engines) are one note on stderr, not its output
    assert "WARNING:" not in result.stderr and "UserWarning" not in result.stderr, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: not shown: ")]
    assert len(notes) <= 1 and len(result.stderr.splitlines()) == len(notes), result.stderr


def test_doctor_notices_that_a_fresh_import_verl_does_not_load_the_plugin():
    result = doctor({"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": ""})
    assert result.returncode == 1
    assert any(line.startswith("BAD  fresh import verl  plugin absent") for line in result.stdout.splitlines())


def test_the_gpu_line_names_the_devices_torch_sees(monkeypatch):
    """The GPU branch, on a machine without one: torch's answers replaced by two H100s."""
    import torch

    from verl_ext.integration.diagnosis import _gpu_count, _gpu_finding

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    assert _gpu_count() == 2
    finding = _gpu_finding(2)
    assert (finding.ok, finding.topic, finding.detail) == (True, "gpu", "2 CUDA device(s): NVIDIA H100 80GB HBM3")
    assert _gpu_finding(0).detail == "none: torch sees no CUDA device, so verl's own trainer cannot run here"

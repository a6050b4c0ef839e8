"""`verl-ext doctor` reports a healthy installation, and notices a plugin verl does not load."""

from __future__ import annotations

import os
import subprocess
import sys

from packaging.version import Version

from tests.integration.conftest import verl_version
from tests.support.forkserver import real_python


def doctor(env_extra: dict | None = None, python: str | None = None, unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {name: value for name, value in {**os.environ, **(env_extra or {})}.items() if name not in unset}
    return subprocess.run(
        [python or sys.executable, "-m", "verl_ext.cli", "doctor"], capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def test_doctor_on_this_installation():
    # verl < 0.9 loads plugins only through VERL_USE_EXTERNAL_MODULES (the documented way there)
    plugins = {} if verl_version() >= Version("0.9.0") else {"VERL_USE_EXTERNAL_MODULES": "verl_ext"}
    # the backend's switch off, as the lines below say; a real interpreter with vLLM's log level unset, as a
    # user's shell starts it (the suite sets it, tests/conftest.py, and its fork server has imported vLLM
    # already): vLLM's first import prints an INFO line on stdout there (issue 59)
    result = doctor({**plugins, "VERL_EXT_CPU": ""}, real_python(), unset=("VLLM_LOGGING_LEVEL",))
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    assert lines[-1].endswith(" ok, 0 broken")
    # nothing but the findings on stdout: not what vLLM prints when first imported (its INFO "Triton not installed")
    assert lines[-2] == "" and all(line.startswith(("ok   ", "BAD  ")) for line in lines[:-2]), lines
    for expected in (
        "verl.trainer.ppo.ray_trainer.compute_advantage",
        "verl.trainer.ppo.v1.trainer_base.PPOTrainer._compute_advantage",
        "mc: registered",
        "gae_ext: registered",
        "critic.enable=null switches the critic on for: mc, td0, nstep, gae_ext",
        "fresh import verl  plugin loaded",
        "ppo path           legacy trainer: every module imports: verl.trainer.main_ppo_v0, ",
        "ppo path           V1 trainer: every module imports: ",
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


def test_doctor_names_a_package_verl_imports_without_declaring_it_and_the_extra_that_brings_it():
    """Issue 59: verl's rollout router imports cachetools, which verl does not declare; a venv with
    verl and verl-ext alone lacked it, doctor said "0 broken" and the selftest failed on it. Here
    cachetools cannot be imported (a ``None`` in ``sys.modules``, as for a package not installed)."""
    blocked = "import sys\nsys.modules['cachetools'] = None\nfrom verl_ext.cli import main\nsys.exit(main(['doctor', '--no-subprocess']))"
    result = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout
    bad = [" ".join(line.split()) for line in result.stdout.splitlines() if line.startswith("BAD")]
    hint = "verl needs cachetools without declaring it; verl-ext's verl-runtime extra brings it: pip install 'verl-ext[verl-runtime]'"
    assert bad == [
        f"BAD ppo path legacy trainer: verl.trainer.main_ppo_v0 imports cachetools, which is not installed: {hint}",
        f"BAD ppo path V1 trainer: verl.trainer.ppo.v1 imports cachetools, which is not installed: {hint}",
    ], result.stdout
    assert result.stdout.splitlines()[-1].endswith(" ok, 2 broken")


def test_the_extra_doctor_names_brings_the_packages_it_says():
    """What doctor says to install (diagnosis.RUNTIME_IMPORTS) is setup.cfg's verl-runtime extra, and each
    import name is its distribution's (the installed packages' own metadata)."""
    import configparser
    from importlib.metadata import packages_distributions
    from pathlib import Path

    from packaging.requirements import Requirement

    from verl_ext.integration.diagnosis import RUNTIME_EXTRA, RUNTIME_IMPORTS

    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    extra = [Requirement(line).name for line in setup.get("options.extras_require", RUNTIME_EXTRA).splitlines() if line.strip()]
    assert sorted(extra) == sorted(RUNTIME_IMPORTS.values())
    provides = packages_distributions()
    assert {name: provides[name][0] for name in RUNTIME_IMPORTS} == RUNTIME_IMPORTS


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

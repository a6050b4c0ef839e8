"""verl_ext.nonfinite in verl's real RayPPOTrainer.fit() on CPU (in-process, trace off): a NaN the
critic gives at step 2 (tests/e2e/nonfinite_probe.py) is named in one line; warn trains on, raise
stops the run with that line before step 2's updates. One fresh interpreter per run. The warn run
also shows the live metrics (verl_ext.metrics) in verl's metrics with the trace off.

Covers: verl_ext.nonfinite and verl_ext.integration.nonfinite_hook (warn and raise), verl_ext.options,
verl_ext.integration.metrics_hook with verl_ext.step_metrics, and the CPU backend (verl_ext.cpu) with
the arithmetic task's assets (verl_ext.tasks.arith)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu.helpers import CONFIGS, RAY_GROUP, SCENARIOS, read_batches

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.skipif(
        __import__("torch").cuda.is_available(), reason="verl-ext's CPU backend refuses to run on a host with a CUDA GPU"
    ),
    pytest.mark.usefixtures("assets"),  # built once, under the suite's lock (tests/conftest.py)
]


def run_with_nan(out: Path, mode: str) -> subprocess.CompletedProcess:
    # its own run: a NaN planted in the critic's values (tests/e2e/nonfinite_probe.py) spoils it for any other test
    from verl_ext.tasks.arith.assets import build_assets
    from verl_ext.tasks.common import default_cache_dir
    from verl_ext.cpu.overrides import cpu_environment

    build_assets(default_cache_dir())
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        **cpu_environment(out),
        "VERL_EXT_CPU_ASSETS": str(default_cache_dir()),
        "PYTHONPATH": str(ROOT),
        "VERL_USE_EXTERNAL_MODULES": "tests.e2e.nonfinite_probe",
        "VERL_EXT_TEST_NAN_DIR": str(out),
        "VERL_EXT_TEST_NAN_STEP": "2",
    }
    command = [
        sys.executable, str(SCENARIOS), "in-process", str(out), "--estimator", "mc", "--steps", "2",
        "--config-dir", str(CONFIGS), "--config-name", "verl_ext_trainer", "--", f"verl_ext.nonfinite={mode}",
    ]  # fmt: skip
    result = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=600)
    (out / "output.log").write_text(result.stdout + result.stderr)
    return result


def expected_line(out: Path, valid: int, first_uid: str) -> str:
    injected = json.loads((out / "injected.json").read_text())
    return (
        f"verl-ext: step 2: advantages not finite on {valid} of {valid} valid tokens, first nan at sample 0 "
        f"(uid {first_uid}), token 0; first non-finite upstream: values, nan at sample 3 (uid {injected['uid']}), "
        f"token {injected['token']} (1 valid token)"
    )


def test_warn_names_the_nan_value_and_training_goes_on(tmp_path):
    result = run_with_nan(tmp_path / "warn", "warn")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    step = read_batches(tmp_path / "warn")["steps"][2]  # the batch step 2's updates used
    said = [line for line in result.stderr.splitlines() if line.startswith("verl-ext: step")]
    assert said == [expected_line(tmp_path / "warn", int(step["response_mask"].sum()), step["uid"][0])]
    assert (tmp_path / "warn" / "updates.txt").read_text().split("\n")[:-1] == ["1 critic", "1 actor", "2 critic", "2 actor"]
    assert_live_metrics_without_the_trace(tmp_path / "warn")


def assert_live_metrics_without_the_trace(out: Path) -> None:
    """The trace is off in this run: verl's metrics of step 1 (finite) still hold the live metrics,
    equal to docs/definitions.md §9 summed directly on the batch the step used."""
    import tests.support.reference as ref
    from verl_ext.apps.learning import read_metrics

    batches = read_batches(out)
    batch = {key: value.numpy() if hasattr(value, "numpy") else value for key, value in batches["steps"][1].items()}
    mask, rewards, values = batch["response_mask"], batch["token_level_rewards"], batch["values"]
    raw = ref.mc_returns(rewards, mask, batches["gamma"]) - values  # mc
    want = ref.live_metrics(rewards, values, raw, batch["advantages"], batch["token_level_scores"], mask, batch["uid"], batches["gamma"])
    want |= ref.offpolicy_gap(batch["old_log_probs"], batch["rollout_log_probs"], mask)  # the rollout's log-probs, no correction
    live = {key.removeprefix("verl_ext/"): value for key, value in read_metrics(out)[1].items() if key.startswith("verl_ext/")}
    assert not (out / "trace").exists() and sorted(live) == sorted(want)
    for key, value in want.items():
        assert live[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key


def test_raise_stops_the_run_with_that_line_before_the_update(tmp_path):
    result = run_with_nan(tmp_path / "raise", "raise")
    assert result.returncode != 0
    error = next(line for line in result.stderr.splitlines() if "NonFiniteError" in line)
    line = error.split("NonFiniteError: ", 1)[1]
    assert line.startswith("verl-ext: step 2: advantages not finite on ")
    injected = json.loads((tmp_path / "raise" / "injected.json").read_text())
    assert line.endswith(f"first non-finite upstream: values, nan at sample 3 (uid {injected['uid']}), token {injected['token']} (1 valid token)")
    assert (tmp_path / "raise" / "updates.txt").read_text().split("\n")[:-1] == ["1 critic", "1 actor"]


# --------------------------------------------------------------------------- the V1 trainer, on Ray


def run_v1_with_nan(out: Path, mode: str, steps: int, ray_cluster) -> subprocess.CompletedProcess:
    """``python -m verl.trainer.main_ppo`` with verl-ext's config, trainer.use_v1=True, the probe in every
    process; the NaN at step 1."""
    from verl_ext.tasks.arith.assets import build_assets
    from verl_ext.cpu.overrides import cpu_environment, cpu_overrides, merge_overrides

    out.mkdir(parents=True, exist_ok=True)
    probe = {
        "PYTHONPATH": str(ROOT),
        "VERL_USE_EXTERNAL_MODULES": "tests.e2e.nonfinite_probe",
        "VERL_EXT_TEST_NAN_DIR": str(out),
        "VERL_EXT_TEST_NAN_STEP": "1",
    }
    overrides = merge_overrides(
        cpu_overrides(build_assets(), out, steps=steps, estimator="mc", use_v1=True, ray_address=ray_cluster.address),
        [
            f"verl_ext.nonfinite={mode}",
            "trainer.val_before_train=False",  # nothing here reads a validation
            *ray_cluster.v1_overrides,
            *(f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{v}'" for k, v in probe.items()),
        ],
    )
    command = [sys.executable, "-m", "verl.trainer.main_ppo", f"--config-path={CONFIGS}", "--config-name=verl_ext_trainer", *overrides]
    env = {**os.environ, **cpu_environment(out), **probe}
    result = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=900)
    (out / "output.log").write_text(result.stdout + result.stderr)
    return result


@pytest.mark.xdist_group(RAY_GROUP)  # one Ray run at a time, on the suite's cluster (tests/conftest.py)
def test_v1_raise_stops_the_run_with_that_line_before_the_update(tmp_path, ray_cluster):
    out = tmp_path / "v1"
    result = run_v1_with_nan(out, "raise", steps=2, ray_cluster=ray_cluster)
    assert result.returncode != 0
    injected = json.loads((out / "injected.json").read_text())
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "NonFiniteError: verl-ext: step 1:" in line]
    assert lines, (result.stdout + result.stderr)[-4000:]
    assert lines[0].split("NonFiniteError: ", 1)[1].endswith(
        f"first non-finite upstream: values, nan at sample 3 (uid {injected['uid']}), token {injected['token']} (1 valid token)"
    )
    assert not (out / "updates.txt").exists()  # no update of step 1 ran

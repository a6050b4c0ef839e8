"""``verl-ext selftest`` without a trainer run: its screen from a fake result, the first failure of a
planted failing check, the one-line diagnosis of a planted failing log, what ran from a config, and a
bad override, which fails at config composition in one line (exit 2) before anything starts. Its real runs, and a
planted wrong estimator: tests/e2e/test_selftest.py.

Covers: verl_ext.apps.selftest_report, the composition step of verl_ext.apps.selftest and the
``selftest`` command of verl_ext.cli."""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_ext.apps.selftest_report import RunOutcome, diagnose_log, first_failure, format_screen, what_ran
from verl_ext.check.results import IdentityResult, Location, Violation


def identity(name: str, status: str, first: Violation | None = None, notes: tuple[str, ...] = ()) -> IdentityResult:
    return IdentityResult(name, name, "1e-6", status, 10, 1 if status == "fail" else 0, None, first, notes)


@dataclass
class PlantedReport:
    """What selftest reads of a check report: its identities in order, and what was not evaluated."""

    identities: tuple[IdentityResult, ...]
    not_checked: dict = field(default_factory=dict)


def test_the_first_failure_names_the_identity_step_sample_and_token():
    violation = Violation(Location(2, 3, 5), "advantage", actual=1.5, expected=1.0, error=0.5, tolerance=1e-6)
    report = PlantedReport((
        identity("advantages", "pass"),
        identity("returns", "fail", violation),
        identity("ratio", "fail", Violation(Location(1, 0, 0), "ratio", actual=2.0, expected=1.0, error=1.0, tolerance=1e-6)),
    ))  # fmt: skip
    assert first_failure(report) == "returns: step 2, sample 3, token 5: advantage = 1.5, expected 1 (|Δ| 5.00e-01 > tolerance 1.00e-06)"


def test_a_failure_without_a_token_says_its_note_and_an_unevaluated_identity_says_why():
    assert first_failure(PlantedReport((identity("steps_on_disk", "fail", notes=("step 2 is missing",)),))) == "steps_on_disk: step 2 is missing"
    unchecked = PlantedReport((identity("returns", "unchecked"),), {"my_estimators does not import": ("returns", "advantages")})
    assert first_failure(unchecked) == "not evaluated here: returns, advantages (my_estimators does not import)"


def test_the_screen_shows_what_ran_each_run_and_the_time():
    setting = {"device": "cpu × 1", "rollout": "hf_generate"}
    outcomes = [
        RunOutcome("mc", "PASS", 61.2),
        RunOutcome("grpo", "FAIL", 70.0, "returns: step 1, sample 0, token 0: returns = 1, expected 2", "/tmp/x/grpo/train.log"),
    ]
    screen = format_screen(setting, ["trainer.use_v1=True"], outcomes, 140.4, "/tmp/x").splitlines()
    assert screen == [
        "what ran:",
        "  device     cpu × 1",
        "  rollout    hf_generate",
        "  overrides  trainer.use_v1=True",
        "",
        "  mc    PASS          61 s",
        "  grpo  FAIL          70 s  returns: step 1, sample 0, token 0: returns = 1, expected 2  (log: /tmp/x/grpo/train.log)",
        "",
        "FAIL: selftest in 140 s; outputs in /tmp/x",
    ]
    assert format_screen(setting, [], outcomes[:1], 61.0, "/tmp/x").splitlines()[-1] == "PASS: selftest in 61 s; outputs in /tmp/x"


RAY_LOG = """\
(TaskRunner pid=123) Traceback (most recent call last):
(TaskRunner pid=123)   File "verl/trainer/main_ppo.py", line 300, in run
(TaskRunner pid=123) ValueError: ppo_mini_batch_size (8) must be divisible by micro-batch size (3)
Traceback (most recent call last):
  File "verl/trainer/main_ppo.py", line 42, in main
ray.exceptions.RayTaskError(ValueError): ray::TaskRunner.run() (pid=123, ip=10.0.0.1)
  File "verl/trainer/main_ppo.py", line 300, in run
ValueError: ppo_mini_batch_size (8) must be divisible by micro-batch size (3)
"""


def test_a_failed_runs_log_becomes_verls_error_in_one_line():
    assert diagnose_log(RAY_LOG) == "ValueError: ppo_mini_batch_size (8) must be divisible by micro-batch size (3)"
    # Ray's wrapper alone: the error it wraps, named
    wrapped = "ray.exceptions.RayTaskError(RuntimeError): ray::WorkerDict.init() (pid=9)\n"
    assert diagnose_log(wrapped) == "RuntimeError: ray::WorkerDict.init() (pid=9)"
    hydra = "Could not override 'trainer.bogus'.\nTo append to your config use +trainer.bogus=1\nKey 'bogus' is not in struct\n"
    assert diagnose_log(hydra) == "Could not override 'trainer.bogus'. To append to your config use +trainer.bogus=1"
    assert diagnose_log("Killed\n") == "Killed"
    assert len(diagnose_log("ValueError: " + "x" * 1000)) == 240


def test_what_ran_reads_the_composed_config():
    config = {
        "trainer": {"nnodes": 2, "n_gpus_per_node": 8, "use_v1": True},
        "actor_rollout_ref": {
            "hybrid_engine": True,
            "model": {"use_remove_padding": True},
            "actor": {"strategy": "fsdp2", "ulysses_sequence_parallel_size": 2, "use_dynamic_bsz": True, "fsdp_config": {}},
            "rollout": {"name": "vllm", "mode": "async", "dtype": "bfloat16", "tensor_model_parallel_size": 4},
        },
    }
    ran = what_ran(config, "cuda", {"verl": "0.9.1", "verl_ext": "0.2.0"})
    assert ran["device"] == "cuda × 16 (2 nodes × 8)"
    assert ran["versions"] == "verl 0.9.1, verl-ext 0.2.0"
    assert ran["precision"] == "fsdp2 params bf16 (verl default), reductions fp32 (verl default); rollout bfloat16"
    assert ran["rollout"] == "vllm (async; tensor 4, data 1, pipeline 1)"
    assert ran["trainer"] == "V1 PPOTrainer, hybrid engine"
    assert ran["ranks"] == "data-parallel 8; actor sequence (Ulysses) 2"  # 16 ranks / 2 per sequence group
    assert ran["batches"] == "packed (use_remove_padding), micro-batches by token count (use_dynamic_bsz)"
    config["actor_rollout_ref"]["rollout"]["name"] = "hf_generate"  # its own dtypes, whatever the config says
    assert what_ran(config, "cuda", {})["precision"].endswith("; rollout float32")
    assert what_ran(config, "cpu", {})["precision"].endswith("; rollout float64")


def test_a_bad_override_fails_at_composition_in_one_line_before_any_trainer(run_cli, assets, tmp_path):
    """Issue 59: one line and exit 2 before anything starts (it was a screen with both runs ERROR, exit 1,
    after the output directory was made)."""
    code, out, err = run_cli("selftest", "-q", "--output-dir", str(tmp_path / "out"), "--", "trainer.no_such_key=1")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("verl-ext selftest: trainer.no_such_key is not a key of the trainer's config")
    assert not (tmp_path / "out").exists()  # no folder, no trainer


def test_a_misspelt_key_names_the_nearest_keys_and_a_bad_value_fails_before_ray(run_cli, assets, tmp_path):
    """Issue 43: a key typo gets the keys it was meant to be, not hydra's "append with +"; a value
    verl-ext's options refuse fails at composition too, before Ray or a trainer starts."""
    code, out, err = run_cli("selftest", "-q", "--output-dir", str(tmp_path / "typo"), "--", "trainer.total_training_step=2")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "did you mean trainer.total_training_steps?" in err
    code, out, err = run_cli("selftest", "-q", "--output-dir", str(tmp_path / "value"), "--", "algorithm.truncation=maybe")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "algorithm.truncation must be one of terminal, bootstrap, mask, got 'maybe'" in err
    assert list(tmp_path.iterdir()) == []


def test_the_cpu_only_vllm_settings_apply_under_the_cpu_backend_only(assets, tmp_path, monkeypatch):
    """verl's vLLM rollout in the selftest: on a CPU-only machine with the CPU backend's settings (no
    sleep mode, eager, no batch invariance, fp32, the engine's worker in its own process); on a CUDA
    machine with verl's own GPU defaults, untouched."""
    import torch

    from verl_ext.apps.selftest import RUNS, _compose, _plan

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # the cuda plan as on a one-GPU machine (verl validates it)
    mc = RUNS[0]
    rollouts = {
        device: _compose(_plan(mc, assets, tmp_path / device, device, [], None, "fp32", "vllm"))["actor_rollout_ref"]["rollout"]
        for device in ("cpu", "cuda")
    }
    cpu, gpu = rollouts["cpu"], rollouts["cuda"]
    assert cpu["name"] == gpu["name"] == "vllm"
    assert (cpu["enable_sleep_mode"], cpu["free_cache_engine"], cpu["enforce_eager"], cpu["full_determinism"]) == (False, False, True, False)
    assert cpu["dtype"] == "float32" and cpu["engine_kwargs"]["vllm"] == {"distributed_executor_backend": "uni"}
    # verl's own defaults (trainer/config/rollout/rollout.yaml; sleep mode is RolloutConfig's default, True)
    assert "enable_sleep_mode" not in gpu
    assert (gpu["free_cache_engine"], gpu["enforce_eager"], gpu["full_determinism"], gpu["dtype"]) == (True, False, False, "bfloat16")
    assert gpu["engine_kwargs"]["vllm"] == {}
    bf16 = _compose(_plan(mc, assets, tmp_path / "bf16", "cpu", [], None, "bf16", "vllm"))["actor_rollout_ref"]["rollout"]
    assert bf16["dtype"] == "bfloat16"  # PRECISION=bf16: vLLM computes in bfloat16 too

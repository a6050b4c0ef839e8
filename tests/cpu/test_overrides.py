"""The CPU overrides: merge rules, and they compose against verl's own config and pass its validation."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest

from verl_ext.cpu.overrides import cpu_overrides, merge_overrides, override_key


def test_merge_keeps_the_last_setting_of_a_key():
    merged = merge_overrides(["a.b=1", "+c.d=2", "e=3"], ["a.b=4", "c.d=5"])
    assert merged == ["a.b=4", "+c.d=5", "e=3"]
    assert override_key("+x.y=z=w") == "x.y"


def parsed(overrides: list[str]) -> dict:
    """key -> value, as Hydra's own parser reads ``overrides``; fails on a key named twice."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    settings = OverridesParser.create().parse_overrides(overrides)
    keys = [setting.key_or_group for setting in settings]
    assert len(keys) == len(set(keys)), sorted({key for key in keys if keys.count(key) > 1})
    return {setting.key_or_group: setting.value() for setting in settings}


def test_overrides_name_each_key_once(assets, tmp_path):
    """Hydra refuses an added key (``+key``) given twice and keeps the last setting of another: where
    the defaults, vLLM's settings and a task's own overrides set the same key, the list names it once,
    with the later setting; the caller's arguments land where they say."""
    from verl_ext.tasks.tool.assets import TOOLS_FILE, ToolAssets

    tool = ToolAssets(
        root=tmp_path, model_dir=tmp_path / "model", train_file=tmp_path / "train.parquet", val_file=tmp_path / "val.parquet",
        reward_file=tmp_path / "reward.py", tools_file=TOOLS_FILE, warm_start_report=tmp_path / "warm_start.json",
        critic_dir=tmp_path / "critic", value_pretraining_report=tmp_path / "value_pretraining.json",
    )  # fmt: skip
    for task_assets, rollout, use_v1, use_ray in itertools.product((assets, tool), ("hf_generate", "vllm"), (False, True), (False, True)):
        settings = parsed(
            cpu_overrides(task_assets, tmp_path, estimator="grpo", rollout_n=4, use_v1=use_v1, use_ray=use_ray, rollout=rollout)
        )
        assert (settings["algorithm.adv_estimator"], settings["actor_rollout_ref.rollout.n"]) == ("grpo", 4)
        assert settings["trainer.use_v1"] is use_v1 and settings["actor_rollout_ref.rollout.name"] == rollout
        # verl's vLLM rollout on vLLM's CPU build turns full determinism off (its kernels are Triton's)
        assert settings["actor_rollout_ref.rollout.full_determinism"] is (rollout == "hf_generate")
        # the tool task's own response length (32 tokens, ToolAssets' max_response_length) wins over the default 16
        assert settings["data.max_response_length"] == (32 if task_assets is tool else 16)
        assert settings.get("actor_rollout_ref.rollout.multi_turn.enable", False) is (task_assets is tool)
        assert any(key.startswith("ray_kwargs.") for key in settings) is use_ray


VALIDATE = """
import json, sys
from verl_ext.cpu.overrides import compose_config
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
reports = []
for overrides in json.loads(sys.argv[1]):
    config = compose_config(overrides)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    reports.append({"rollout": config.actor_rollout_ref.rollout.name, "critic": need_critic(config),
                    "strategy": config.critic.strategy, "n": config.actor_rollout_ref.rollout.n})
print(json.dumps(reports))
"""

CASES = [  # (estimator, rollout_n, use_ray, use_v1) -> critic expected
    (("gae", 1, True, False), True),
    (("gae", 1, True, True), True),
    (("grpo", 4, True, False), False),
    (("gae", 1, False, False), True),
]


def test_overrides_compose_and_pass_verls_validation(assets, tmp_path):
    override_lists = [
        cpu_overrides(assets, tmp_path, estimator=estimator, rollout_n=n, use_ray=use_ray, use_v1=use_v1)
        for (estimator, n, use_ray, use_v1), _ in CASES
    ]
    completed = subprocess.run(
        [sys.executable, "-c", VALIDATE, json.dumps(override_lists)],
        env={**os.environ, "VERL_EXT_CPU": "1"}, capture_output=True, text=True, timeout=180,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    reports = json.loads(completed.stdout.strip().splitlines()[-1])
    expected = [
        {"rollout": "hf_generate", "critic": critic, "strategy": "fsdp2", "n": n} for (_, n, _, _), critic in CASES
    ]
    assert reports == expected


def test_the_learning_recipe_sizes_its_batches_from_the_batch_it_ends_up_with(assets_dir, assets, tmp_path, monkeypatch):
    """`verl-ext demo data.train_batch_size=8` used to die inside verl ("data size must be divisible
    by force_group_size * micro_batch_size_per_gpu"): the mini-batches were sized for 32 prompts."""
    from pathlib import Path

    import pytest

    from verl_ext.apps.learning import learning_overrides
    from verl_ext.cpu.overrides import compose_config
    from verl_ext.errors import UsageError

    monkeypatch.setenv("VERL_EXT_CPU_ASSETS", str(assets_dir))
    configs = Path(__file__).resolve().parents[2] / "verl_ext" / "configs"
    for extra, prompts, samples in ((["data.train_batch_size=8"], 8, 4), (["data.train_batch_size=7", "actor_rollout_ref.rollout.n=2"], 7, 2), ([], 32, 4)):
        overrides = learning_overrides(tmp_path, "mc", 0, 2, 2, extra=extra)
        config = compose_config(overrides, config_dir=configs, config_name="verl_ext_trainer")
        assert config.data.train_batch_size == prompts and config.actor_rollout_ref.rollout.n == samples
        for role in (config.actor_rollout_ref.actor, config.critic):
            mini, micro = role.ppo_mini_batch_size, role.ppo_micro_batch_size_per_gpu
            assert prompts % mini == 0, (extra, mini)  # whole mini-batches per step
            assert (mini * samples) % micro == 0, (extra, mini, micro)  # whole micro-batches per mini-batch
        assert config.actor_rollout_ref.actor.ppo_mini_batch_size == (prompts // 2 if prompts % 2 == 0 else prompts)
    with pytest.raises(UsageError, match="data.train_batch_size must be an integer >= 1, got '0'"):
        learning_overrides(tmp_path, "mc", 0, 2, 2, extra=["data.train_batch_size=0"])


PRECISION = """
import json, sys
from verl_ext.cpu.overrides import compose_config
reports = []
for overrides in json.loads(sys.argv[1]):
    config = compose_config(overrides)
    engines = (config.actor_rollout_ref.actor.fsdp_config, config.actor_rollout_ref.ref.fsdp_config, config.critic.fsdp)
    reports.append([None if e.get("mixed_precision") is None else dict(e.mixed_precision) for e in engines])
print(json.dumps(reports))
"""


def test_bf16_leaves_verls_mixed_precision_unset_and_fp32_forces_it(assets, tmp_path):
    # unset is what a GPU run has: verl's FSDPEngine then uses bf16 parameters and autocast, fp32
    # reduce and buffers (workers/engine/fsdp/transformer_impl.py, _build_fsdp_module)
    override_lists = [cpu_overrides(assets, tmp_path, precision=precision) for precision in ("bf16", "fp32")]
    completed = subprocess.run(
        [sys.executable, "-c", PRECISION, json.dumps(override_lists)],
        env={**os.environ, "VERL_EXT_CPU": "1"}, capture_output=True, text=True, timeout=180,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    bf16, fp32 = json.loads(completed.stdout.strip().splitlines()[-1])
    assert bf16 == [None, None, None]
    assert fp32 == [dict.fromkeys(("param_dtype", "reduce_dtype", "buffer_dtype"), "fp32")] * 3
    assert cpu_overrides(assets, tmp_path) == override_lists[1]  # fp32 stays the default


def test_an_unknown_precision_names_the_valid_ones(assets, tmp_path):
    with pytest.raises(ValueError, match=r"^precision 'fp16': expected one of fp32, bf16$"):
        cpu_overrides(assets, tmp_path, precision="fp16")


def test_the_learning_runs_pass_the_precision_on(assets_dir, assets, tmp_path, monkeypatch):
    from verl_ext.apps.learning import learning_overrides, main

    monkeypatch.setenv("VERL_EXT_CPU_ASSETS", str(assets_dir))
    mixed = [o for o in learning_overrides(tmp_path, "mc", 0, 2, 2) if ".mixed_precision." in o]
    assert len(mixed) == 9  # actor, reference and critic, three dtypes each: fp32 by default
    assert not [o for o in learning_overrides(tmp_path, "mc", 0, 2, 2, precision="bf16") if ".mixed_precision." in o]
    with pytest.raises(SystemExit):  # argparse's one line naming the choices
        main([str(tmp_path), "--precision", "fp16"])


def test_a_users_modules_are_found_in_the_directory_the_command_started_from(tmp_path):
    """Issue 43: with VERL_USE_EXTERNAL_MODULES set, a CPU run's environment puts the directory the user
    started from first on PYTHONPATH (the trainer runs in its output directory, Ray's workers in Ray's)."""
    from verl_ext.cpu.overrides import user_modules_path

    modules = {"VERL_USE_EXTERNAL_MODULES": "my_estimators"}
    assert user_modules_path({**modules, "PYTHONPATH": "/a:/b"}, tmp_path) == {"PYTHONPATH": f"{tmp_path}:/a:/b"}
    assert user_modules_path({**modules, "PYTHONPATH": f"/a:{tmp_path}"}, tmp_path) == {"PYTHONPATH": f"{tmp_path}:/a"}
    assert user_modules_path(modules, tmp_path) == {"PYTHONPATH": str(tmp_path)}
    assert user_modules_path({"PYTHONPATH": "/a"}, tmp_path) == {}  # no modules to find: PYTHONPATH is left alone

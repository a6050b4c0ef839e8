"""Every GSM8K recipe's overrides compose against verl's ppo_trainer.yaml (through verl-ext's
config) and pass verl's own validate_config, with the tiny local model and data substituted."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "recipes").glob("gsm8k_*.sh") if p.name != "gsm8k_common.sh")


def recipe_overrides(recipe: Path, assets, trace_root: Path) -> list[str]:
    env = {
        **os.environ,
        "MODEL_PATH": str(assets.model_dir),
        "DATA_DIR": str(assets.root),
        "TRACE_ROOT": str(trace_root),
    }
    out = subprocess.run(["bash", str(recipe), "--print-overrides"], capture_output=True, text=True, env=env, check=True)
    # the tiny assets name their files train/val; GSM8K's preprocessing names them train/test
    return [line.replace("/test.parquet", "/val.parquet") for line in out.stdout.splitlines()]


def test_there_is_a_recipe_per_estimator():
    names = {p.stem.removeprefix("gsm8k_") for p in RECIPES}
    assert names == {"mc", "td0", "nstep", "gae_ext", "gae"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_composes_and_passes_verls_validation(recipe, assets, tmp_path):
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_ext import registry
    from verl_ext.options import TraceOptions

    overrides = recipe_overrides(recipe, assets, tmp_path)
    with initialize_config_dir(config_dir=str(ROOT / "verl_ext" / "configs"), version_base=None):
        config = compose(config_name="verl_ext_trainer", overrides=overrides)
    assert config.actor_rollout_ref.model.path == str(assets.model_dir)
    use_critic = need_critic(config)
    assert use_critic  # every recipe is value-based
    validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=use_critic)
    trace = TraceOptions.from_config(config)
    assert trace.enabled and trace.dir == str(tmp_path / recipe.stem.removeprefix("gsm8k_"))
    registry.get(config.algorithm.adv_estimator).settings(config.algorithm)  # verl's gae included


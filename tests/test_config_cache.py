"""Hydra's YAML files read once per test process (tests/support/config_cache.py, installed by tests/conftest.py):
a composition through it is the composition Hydra makes without it (a fresh interpreter's, which
does not install it), each composition gets its own objects, and a file changed on disk is read again.

Covers: tests/support/config_cache.py."""

from __future__ import annotations

import json
import subprocess
import sys

COMPOSE = """
import json, sys
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
configs = []
for overrides in json.loads(sys.argv[1]):
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        configs.append(OmegaConf.to_container(compose(config_name="ppo_trainer", overrides=overrides), resolve=False))
print(json.dumps(configs))
"""

OVERRIDES = [
    ["algorithm.adv_estimator=gae", "algorithm.gamma=0.97"],
    ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "critic.enable=False"],
    ["algorithm.adv_estimator=gae", "algorithm.gamma=0.9"],
]


def test_a_composition_is_hydras_own():
    from hydra import compose, initialize_config_module
    from hydra._internal.sources_registry import SourcesRegistry
    from omegaconf import OmegaConf

    assert SourcesRegistry.instance().resolve("pkg").load_config.cached  # installed in this process
    here = []
    for overrides in OVERRIDES:
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            here.append(OmegaConf.to_container(compose(config_name="ppo_trainer", overrides=overrides), resolve=False))
    fresh = subprocess.run([sys.executable, "-c", COMPOSE, json.dumps(OVERRIDES)], capture_output=True, text=True, timeout=120, check=True)
    assert here == json.loads(fresh.stdout)
    assert [config["algorithm"]["gamma"] for config in here] == [0.97, 1.0, 0.9]


def test_each_composition_has_its_own_objects_and_a_changed_file_is_read_again(tmp_path):
    from hydra import compose, initialize_config_dir

    (tmp_path / "main.yaml").write_text("defaults:\n  - part: a\n  - _self_\nvalue: 1\n")
    (tmp_path / "part").mkdir()
    (tmp_path / "part" / "a.yaml").write_text("x: 1\n")

    def composed(*overrides):
        with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
            return compose(config_name="main", overrides=list(overrides))

    first = composed()
    first.part.x = 99
    assert composed().part.x == 1 and composed("value=2").value == 2
    (tmp_path / "part" / "a.yaml").write_text("x: 22\n")  # another size: read again whatever the clock
    assert composed().part.x == 22

"""Hydra's YAML files read once, and its compositions made once, per test process (tests/support/config_cache.py,
installed by tests/conftest.py): a composition through it, the first or a repeated one, is the composition Hydra
makes without it (a fresh interpreter's, which does not install it), each composition gets its own objects, a file
changed or added on disk is read, a composition in another working directory records that directory, and one that
warns warns each time.

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
    ["algorithm.adv_estimator=gae", "algorithm.gamma=0.97"],  # the first again: the composition kept
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
    assert [config["algorithm"]["gamma"] for config in here] == [0.97, 1.0, 0.9, 0.97]


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


def test_a_file_added_to_a_group_is_composed(tmp_path):
    """An optional default that has no file composes without it, and with it once the file is there."""
    from hydra import compose, initialize_config_dir

    (tmp_path / "main.yaml").write_text("defaults:\n  - optional extra: more\n  - _self_\nvalue: 1\n")
    (tmp_path / "extra").mkdir()

    def composed():
        with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
            return compose(config_name="main")

    assert "extra" not in composed()
    (tmp_path / "extra" / "more.yaml").write_text("y: 3\n")
    assert composed().extra.y == 3


def test_the_working_directory_and_the_warnings_are_each_compositions(tmp_path, monkeypatch):
    """Hydra records the working directory in ``hydra.runtime.cwd``, and warns about a search path that
    does not exist: the same composition from two directories records each, and warns each time."""
    import pytest
    from hydra import compose, initialize_config_dir

    (tmp_path / "main.yaml").write_text(f"hydra:\n  searchpath: [file://{tmp_path / 'absent'}]\nvalue: 1\n")
    (tmp_path / "here").mkdir()

    def composed():
        with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
            return compose(config_name="main", return_hydra_config=True)

    for directory in (tmp_path, tmp_path / "here", tmp_path):
        monkeypatch.chdir(directory)
        with pytest.warns(UserWarning, match="is not available"):
            assert composed().hydra.runtime.cwd == str(directory)
    (tmp_path / "main.yaml").write_text("value: 1\n")
    for directory in (tmp_path, tmp_path / "here"):
        monkeypatch.chdir(directory)
        assert composed().hydra.runtime.cwd == str(directory)

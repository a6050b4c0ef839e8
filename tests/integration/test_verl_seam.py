"""verl-ext inside verl 0.9.1: registration, both trainers' advantage paths (verl's typed AlgoConfig too),
critic rule, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tests.support.reference as ref
from tests.integration.conftest import CONFIG_DIR, make_batch, requires_verl, run_python
from verl_ext.integration.patches import REGISTERED_IN_VERL
from verl_ext.options import ALGORITHM_KEYS

ESTIMATOR_NAMES = ("mc", "td0", "nstep", "gae_ext", "turn_gae")

OPTIONS = ["algorithm.gamma=0.97", "algorithm.lam=0.9", "algorithm.n_step=3"]


def reference_returns(name, rewards, values, mask):
    if name == "mc":
        return ref.mc_returns(rewards, mask, 0.97)
    if name == "td0":
        return ref.td0_returns(rewards, values, mask, 0.97)
    if name == "nstep":
        return ref.nstep_returns(rewards, values, mask, 0.97, 3)
    return ref.gae_advantages(rewards, values, mask, 0.97, 0.9) + values.double().numpy()  # gae_ext, turn_gae


def reference_raw_advantage(name, rewards, values, mask, returns):
    if name == "turn_gae":  # one A_k per turn (make_batch's hole at 3-4 makes two turns)
        return ref.turn_gae_advantages(rewards, values, mask, 0.97, 0.9)
    return returns - values.double().numpy()


def data_proto(rewards, values, mask):
    from verl import DataProto

    rows = rewards.shape[0]
    return DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "values": values, "response_mask": mask},
        non_tensors={"uid": np.array([f"u{i // 2}" for i in range(rows)], dtype=object)},
    )


def assert_matches_reference(data, name, rewards, values, mask):
    valid = mask.bool().numpy()
    expected_returns = reference_returns(name, rewards, values, mask)
    expected_adv = ref.whiten(reference_raw_advantage(name, rewards, values, mask, expected_returns), mask)
    np.testing.assert_allclose(data.batch["returns"].numpy()[valid], expected_returns[valid], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(data.batch["advantages"].numpy()[valid], expected_adv[valid], rtol=1e-4, atol=1e-4)


def test_estimators_are_in_verls_registry():
    from verl.trainer.ppo import core_algos

    for name in ESTIMATOR_NAMES:
        assert core_algos.get_adv_estimator_fn(name) is REGISTERED_IN_VERL[name]
    # verl's own estimators that verl-ext describes stay verl's, never registered a second time
    assert core_algos.get_adv_estimator_fn("gae") is core_algos.compute_gae_advantage_return
    assert core_algos.get_adv_estimator_fn("grpo") is core_algos.compute_grpo_outcome_advantage
    assert set(REGISTERED_IN_VERL) == set(ESTIMATOR_NAMES)


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_legacy_trainer_compute_advantage(compose, name):
    from verl.trainer.ppo import ray_trainer

    rewards, values, mask = make_batch()
    config = compose(f"algorithm.adv_estimator={name}", *OPTIONS)
    data = ray_trainer.compute_advantage(
        data_proto(rewards, values, mask), adv_estimator=name, gamma=0.97, lam=0.9, config=config.algorithm
    )
    assert_matches_reference(data, name, rewards, values, mask)


@requires_verl("0.9.0", "no V1 trainer")
@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_v1_trainer_compute_advantage(compose, name):
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    rewards, values, mask = make_batch(seed=3)
    config = compose(f"algorithm.adv_estimator={name}", *OPTIONS)
    keys = [f"u{i // 2}_{i % 2}_0" for i in range(rewards.shape[0])]
    data = compute_advantage_for_multi_trajectories(
        data_proto(rewards, values, mask), keys, adv_estimator=name, gamma=0.97, lam=0.9, config=config.algorithm
    )
    assert_matches_reference(data, name, rewards, values, mask)


def test_verls_own_gae_still_goes_through_verl(compose):
    from verl.trainer.ppo import core_algos, ray_trainer

    rewards, values, mask = make_batch(seed=5)
    config = compose("algorithm.adv_estimator=gae", "algorithm.lam=0.9")
    data = ray_trainer.compute_advantage(
        data_proto(rewards, values, mask), adv_estimator="gae", gamma=1.0, lam=0.9, config=config.algorithm
    )
    expected_adv, expected_ret = core_algos.compute_gae_advantage_return(rewards, values, mask, 1.0, 0.9)
    torch.testing.assert_close(data.batch["advantages"], expected_adv)
    torch.testing.assert_close(data.batch["returns"], expected_ret)


def test_verls_typed_algorithm_config_works_with_a_verl_ext_estimator():
    """compute_advantage(..., config=AlgoConfig(...)), as verl's signature advertises."""
    from verl import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer

    rewards, values = torch.randn(4, 7, generator=torch.Generator().manual_seed(2)), torch.randn(4, 7)
    mask = torch.ones(4, 7, dtype=torch.int64)
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "values": values, "response_mask": mask})
    config = AlgoConfig(gamma=0.9, lam=0.8, adv_estimator="mc")
    data = ray_trainer.compute_advantage(data, adv_estimator="mc", gamma=0.9, lam=0.8, config=config)
    np.testing.assert_allclose(data.batch["returns"].numpy(), ref.mc_returns(rewards, mask, 0.9), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="algorithm.adv_estimator=nstep needs algorithm.n_step"):
        ray_trainer.compute_advantage(data, adv_estimator="nstep", gamma=0.9, lam=0.8, config=config)


@requires_verl("0.9.0", "no V1 trainer")
def test_modules_that_bind_compute_advantage_at_import_get_the_seam():
    from verl.experimental.separation import ray_trainer as separation
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.v1 import utils as v1_utils

    wrapped = ray_trainer.compute_advantage
    assert hasattr(wrapped, "__verl_ext_original__")
    assert v1_utils.compute_advantage is wrapped
    assert separation.compute_advantage is wrapped


def test_missing_values_is_explained(compose):
    from verl import DataProto
    from verl.trainer.ppo import core_algos, ray_trainer

    rewards, _, mask = make_batch()
    config = compose("algorithm.adv_estimator=mc")
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask})
    with pytest.raises(RuntimeError, match="needs the critic's values, but the batch has none"):
        ray_trainer.compute_advantage(data, adv_estimator="mc", config=config.algorithm)
    # a caller that bypasses the seam reaches the registered function without values
    with pytest.raises(RuntimeError, match="verl-ext doctor"):
        core_algos.get_adv_estimator_fn("mc")(token_level_rewards=rewards, response_mask=mask, config=config.algorithm)


# --------------------------------------------------------------------------- critic rule


@pytest.mark.parametrize("name", ESTIMATOR_NAMES)
def test_critic_is_switched_on_for_value_based_estimators(compose, name):
    from verl.trainer.ppo.utils import need_critic

    assert need_critic(compose(f"algorithm.adv_estimator={name}", "algorithm.n_step=2")) is True
    assert need_critic(compose(f"algorithm.adv_estimator={name}", "algorithm.n_step=2", "critic.enable=True"))


def test_explicit_critic_off_with_value_based_estimator_names_the_fix(compose):
    from verl.trainer.ppo.utils import need_critic

    with pytest.raises(ValueError, match=r"algorithm.adv_estimator=td0 needs a critic.*critic.enable=False"):
        need_critic(compose("algorithm.adv_estimator=td0", "critic.enable=False"))


def test_critic_rule_of_verls_estimators_unchanged(compose):
    from verl.trainer.ppo.utils import need_critic

    assert need_critic(compose("algorithm.adv_estimator=gae")) is True
    with pytest.warns(UserWarning, match="Disabled critic"):
        assert need_critic(compose("algorithm.adv_estimator=grpo")) is False


# --------------------------------------------------------------------------- validation before training


def validate(config):
    """verl's validate_config (patched); verl-ext's checks run first, before the model is loaded."""
    from verl.utils.config import validate_config

    validate_config(config, use_reference_policy=False, use_critic=True)


def test_unknown_estimator_lists_valid_names(compose):
    with pytest.raises(ValueError, match=r"algorithm.adv_estimator='gea' is not a known.*gae, gae_ext.*nstep"):
        validate(compose("algorithm.adv_estimator=gea"))


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.n_step=0", r"algorithm.n_step must be an integer >= 1, got 0"),
        ("algorithm.n_step=2.5", r"algorithm.n_step must be an integer >= 1, got 2.5"),
        ("algorithm.gamma=1.5", r"algorithm.gamma must be in \[0, 1\], got 1.5"),
        ("algorithm.lam=-0.1", r"algorithm.lam must be in \[0, 1\], got -0.1"),
        ("algorithm.lam_actor=2", r"algorithm.lam_actor must be in \[0, 1\], got 2"),
        ("algorithm.lam_length_alpha=0", r"algorithm.lam_length_alpha must be > 0, got 0"),
        ("algorithm.whiten_advantages=yes", r"algorithm.whiten_advantages must be true or false, got 'yes'"),
    ],
)
def test_bad_estimator_options_name_key_and_value(compose, override, message):
    name = "nstep" if "n_step" in override else "gae_ext"
    with pytest.raises(ValueError, match=message):
        validate(compose(f"algorithm.adv_estimator={name}", override))


def test_nstep_without_n_is_an_error(compose):
    with pytest.raises(ValueError, match="needs algorithm.n_step"):
        validate(compose("algorithm.adv_estimator=nstep"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["verl_ext.trace.dir=/tmp/x", "verl_ext.trace.every=-1"], r"verl_ext.trace.every must be an integer >= 1, got -1"),
        (["+verl_ext.trace.colour=red"], r"unknown key\(s\) verl_ext.trace.colour"),
        (["verl_ext.trace.dir=/proc/verl_ext_trace"], r"verl_ext.trace.dir: trace dir /proc/verl_ext_trace is not writable"),
    ],
)
def test_bad_trace_options(compose, overrides, message):
    with pytest.raises(ValueError, match=message):
        validate(compose("algorithm.adv_estimator=gae", *overrides))


def test_checking_the_trace_dir_on_the_driver_leaves_nothing_behind(tmp_path):
    from verl_ext.integration.validation import check_trace_dir_writable

    check_trace_dir_writable(str(tmp_path / "new" / "trace"))
    assert list(tmp_path.iterdir()) == []  # not even the directory it had to create
    (tmp_path / "existing").mkdir()
    check_trace_dir_writable(str(tmp_path / "existing"))
    assert list((tmp_path / "existing").iterdir()) == []


@requires_verl("0.9.0", "validate_config runs inside the Ray TaskRunner, i.e. after ray.init")
def test_unknown_estimator_stops_the_real_cli_before_ray_starts():
    result = run_python(
        "import sys; from verl.trainer.main_ppo import main; sys.argv = ['main_ppo', 'algorithm.adv_estimator=mcc']; main()"
    )
    assert result.returncode != 0
    assert "algorithm.adv_estimator='mcc' is not a known advantage estimator" in result.stderr
    assert "ray init kwargs" not in result.stdout  # run_ppo prints this right before ray.init


# --------------------------------------------------------------------------- loading the plugin


#: Prints: plugin loaded?, verl-ext's estimators in verl's registry, and which modules of the CPU
#: backend, the example tasks and the apps were loaded (none: a run without VERL_EXT_CPU is a GPU run).
PROBE = (
    "import os, sys; os.environ.pop('VERL_EXT_CPU', None); import verl; "
    "loaded = 'verl_ext.integration.plugin' in sys.modules; "
    "from verl.trainer.ppo import core_algos; "
    "print(loaded, sorted(set(core_algos.ADV_ESTIMATOR_REGISTRY) & {'mc', 'td0', 'nstep', 'gae_ext'}), "
    "sorted(m for m in sys.modules if m.split('.')[:2] in (['verl_ext', 'cpu'], ['verl_ext', 'tasks'], ['verl_ext', 'apps'])))"
)


@requires_verl("0.9.0", "no entry-point plugins")
def test_plugin_loads_on_plain_import_verl():
    result = run_python(PROBE)
    assert result.stdout.strip().splitlines()[-1] == "True ['gae_ext', 'mc', 'nstep', 'td0'] []", result.stderr


def test_plugin_loads_through_verl_use_external_modules():
    result = run_python(PROBE, {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "verl_ext"})
    assert result.stdout.strip().splitlines()[-1] == "True ['gae_ext', 'mc', 'nstep', 'td0'] []", result.stderr


def test_without_plugin_nothing_is_registered():
    result = run_python(PROBE, {"VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": ""})
    assert result.stdout.strip().splitlines()[-1] == "False [] []", result.stderr


def test_a_broken_plugin_is_loud():
    result = run_python(
        "import sys; sys.modules['verl_ext.integration.patches'] = None; import verl",
        {"VERL_USE_EXTERNAL_MODULES": "verl_ext"},  # what verl < 0.9 needs; 0.9 also loads the entry point
    )
    assert result.returncode == 0  # verl itself still imports
    assert "verl-ext: plugin failed to load" in result.stderr
    assert "verl-ext doctor" in result.stderr


def test_plugin_does_not_import_heavy_verl_modules():
    result = run_python(
        "import sys, verl; print(sorted(m for m in sys.modules if m.startswith('verl.trainer')))"
    )
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout



@requires_verl("0.8.0", "pkg:// hydra search path of verl.trainer.config")
def test_verl_ext_yaml_declares_every_added_key_with_the_documented_defaults():
    """configs/verl_ext_trainer.yaml composes onto ppo_trainer, so no `+` is needed on the CLI."""
    from hydra import compose, initialize_config_dir

    from verl_ext.options import METRICS_DEFAULT, NONFINITE_DEFAULT, TRACE_KEYS, TURN_REWARDS_DEFAULT

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        config = compose(config_name="verl_ext_trainer", overrides=["algorithm.n_step=4", "verl_ext.trace.every=2"])
    assert config.algorithm.n_step == 4 and config.verl_ext.trace.every == 2
    assert config.actor_rollout_ref.rollout.n == 1  # verl's own defaults are all there
    declared = {key: config.algorithm[key] for key in ALGORITHM_KEYS}
    assert declared == {**ALGORITHM_KEYS, "n_step": 4}
    assert dict(config.verl_ext.trace) == {**TRACE_KEYS, "every": 2}
    assert set(config.verl_ext) == {"trace", "nonfinite", "metrics", "turn_rewards"} and config.verl_ext.nonfinite == NONFINITE_DEFAULT
    assert config.verl_ext.turn_rewards is TURN_REWARDS_DEFAULT is False
    assert config.verl_ext.metrics is METRICS_DEFAULT is True

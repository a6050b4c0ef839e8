"""verl 0.9's default V1 trainer, through the real CLI on Ray, with verl's own ppo_trainer.yaml and the
README's example of a user's estimator (loaded in every process through VERL_USE_EXTERNAL_MODULES, as
the README runs it): the plugin switches the critic on and the run trains; the trace equals what the
actor update read from TransferQueue (captured by tests/e2e/v1_capture.py), its update tables cover
every trained token once per epoch and reproduce verl's logged metrics, and it passes the checker."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.cpu.helpers import RAY_GROUP

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # Ray clusters run one at a time (tests/conftest.py)


@pytest.fixture(scope="module")
def v1_run(tmp_path_factory, assets):
    from verl_ext.cpu.overrides import cpu_environment, cpu_overrides, merge_overrides

    from tests.cpu.helpers import run
    from tests.e2e.test_fit_with_trace import UPDATE_OVERRIDES, user_module_env

    out = tmp_path_factory.mktemp("v1")
    capture = out / "captured"
    capture.mkdir()
    user = user_module_env(out)
    overrides = merge_overrides(
        cpu_overrides(assets, out, steps=2, estimator="td_half", use_v1=True),
        [
            "algorithm.use_kl_in_reward=True",
            "algorithm.kl_ctrl.kl_coef=0.05",
            f"+verl_ext.trace.dir={out / 'trace'}",  # verl's own config has no verl_ext node
            *UPDATE_OVERRIDES,
            "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='tests.e2e.v1_capture,my_estimators'",
            f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_EXT_TEST_CAPTURE_DIR='{capture}'",
            f"+ray_kwargs.ray_init.runtime_env.env_vars.PYTHONPATH='{user['PYTHONPATH']}'",
        ],
    )
    run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], {**os.environ, **cpu_environment(out), **user}, out, timeout=600)
    return out


def test_verls_own_config_and_a_users_estimator_train_with_the_critic(v1_run):
    from verl_ext.apps.learning import read_metrics

    from tests.cpu.helpers import assert_trained

    assert_trained(read_metrics(v1_run), 2)  # critic values and critic updates at every step
    assert "(TaskRunnerV1 pid=" in (v1_run / "output.log").read_text()


def test_v1_run_record(v1_run):
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(v1_run / "trace"))
    assert trace.record.trainer == "v1"
    assert trace.steps == [1, 2]
    assert [trace.step_record(s).kl_coef for s in trace.steps] == [pytest.approx(0.05)] * 2


def test_v1_trace_equals_what_the_actor_update_read(v1_run):
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(v1_run / "trace"))
    columns = {
        "score": "rm_scores",
        "reward": "token_level_rewards",
        "value": "values",
        "return": "returns",
        "advantage": "advantages",
        "old_log_prob": "old_log_probs",
        "ref_log_prob": "ref_log_prob",
    }
    for step in trace.steps:
        used = torch.load(v1_run / "captured" / f"step{step}.pt")
        table = trace.read_step(step).to_pandas()
        mask = used["response_mask"].numpy()
        assert table["sample"].nunique() == mask.shape[0]
        positions = (table["sample"].to_numpy(), table["token_index"].to_numpy())
        assert (table["mask"].to_numpy() == (mask[positions] != 0)).all()
        assert (table["token_id"].to_numpy() == used["responses"].numpy()[positions]).all()
        for column, key in columns.items():
            np.testing.assert_array_equal(table[column].to_numpy(np.float32), used[key].float().numpy()[positions])
        raw = (used["returns"] - used["values"]).numpy()[positions]
        np.testing.assert_allclose(table["advantage_raw"].to_numpy(), raw, rtol=1e-5, atol=1e-6)
        assert not np.allclose(table["reward"], table["score"]) or step == 1  # actor == reference at step 1


def test_v1_trace_passes_the_checker(v1_run):
    from tests.e2e.test_fit_with_trace import user_module_env

    result = subprocess.run(
        [sys.executable, "-m", "verl_ext.cli", "check", str(v1_run / "trace"), "--quiet"],
        capture_output=True, text=True, env={**os.environ, **user_module_env(v1_run)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "returns recomputed: td_half" in result.stdout and "8.6" in result.stdout


def test_v1_update_tables_cover_every_trained_token_and_reproduce_verls_metrics(v1_run):
    from verl_ext.apps.learning import read_metrics
    from verl_ext.trace.reader import open_trace

    trace, metrics = open_trace(str(v1_run / "trace")), read_metrics(v1_run)
    assert trace.update_steps == {"actor": [1, 2], "critic": [1, 2]}
    for step in trace.steps:
        used = torch.load(v1_run / "captured" / f"step{step}.pt")
        expected = {(int(i), int(t)) for i, t in np.argwhere(used["response_mask"].numpy() != 0)}
        actor, critic = trace.actor_update(step).to_pandas(), trace.critic_update(step).to_pandas()
        for table in (actor, critic):
            for _, rows in table.groupby("epoch"):
                keys = list(zip(rows["sample"], rows["token_index"]))
                assert len(keys) == len(set(keys)) and set(keys) == expected
        positions = (actor["sample"].to_numpy(), actor["token_index"].to_numpy())
        np.testing.assert_array_equal(actor["advantage"].to_numpy(np.float32), used["advantages"].numpy()[positions])
        pg_loss = actor.groupby(["epoch", "minibatch"])["pg_loss"].mean().mean()
        assert pg_loss == pytest.approx(metrics[step]["actor/pg_loss"], rel=1e-5, abs=1e-7)
        vf_loss = 0.5 * critic.groupby(["epoch", "minibatch"])["vf_loss"].mean().mean()
        assert vf_loss == pytest.approx(metrics[step]["critic/vf_loss"], rel=1e-5, abs=1e-7)

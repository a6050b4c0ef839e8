"""recipes/cpu_demo.sh with verl 0.9's default V1 trainer (``V1=1``), verl's own ppo_trainer.yaml and the
README's example of a user's estimator (loaded in every process through VERL_USE_EXTERNAL_MODULES, as
docs/estimators.md runs it: the module in the directory the recipe is started from), on a local Ray cluster: the recipe reports progress and trains, the plugin
switches the critic on; the trace equals what the actor update read from TransferQueue (captured by
tests/e2e/v1_capture.py), its update tables cover every trained token once per epoch and reproduce
verl's logged metrics, the live metrics verl logged equal the trace's numbers, and it passes the checker;
with verl's rollout correction (sequence-level weights, two rejections chained) held to verl's own function,
replayed as the V1 trainer divides its loss. (The legacy trainer on Ray: tests/e2e/test_multinode.py.)

Covers: the V1 trainer's seam and hooks (verl_ext.integration: plugin, patches, validation,
trace_hook, update_hook, metrics_hook), verl_ext.registry with a user's estimator, verl_ext.trace
(capture, writer, reader), verl_ext.step_metrics, verl_ext.check.run through verl_ext.cli, the
recipe's progress report (verl_ext.apps.progress) and the CPU backend (verl_ext.cpu) on Ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.cpu.helpers import RAY_GROUP, VERL_BATCH_KEYS

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # one Ray run at a time, on the suite's cluster (tests/conftest.py)


RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "cpu_demo.sh"
STEPS = 2
#: verl's rollout correction on the V1 trainer (docs/definitions.md#off-policy-tokens), in the modes the legacy
#: trainer's td0 run leaves out: one weight per sequence, exp(Σ ℓ_t), truncated at 2, and two rejections chained,
#: each token off the ratio 1 by more than 0.5% and each response whose largest ½ℓ_t² exceeds 2e-4 (|ℓ_t| > 0.02;
#: the bf16 trainer and the float64 rollout disagree by 2e-3 at the median, up to about 2e-2: a few tokens, at
#: most a response or two)
CORRECTION = {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1,seq_max_k2", "rollout_rs_threshold": "0.995_1.005,2e-4"}


@pytest.fixture(scope="module")
def v1_run(tmp_path_factory, assets_dir, assets, ray_cluster):
    # its own run: the V1 trainer on Ray through the recipe, with a capture of what the actor update read
    from tests.cpu.helpers import run
    from verl_ext.cpu.overrides import merge_overrides

    from tests.e2e.gpu_world import GPU_WORLD_OVERRIDES
    from tests.e2e.test_fit_with_trace import CUT_AT, ROOT, UPDATE_OVERRIDES, user_module_env

    out = tmp_path_factory.mktemp("v1")
    capture = out / "captured"
    capture.mkdir()
    user = user_module_env(out)
    overrides = [
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_ctrl.kl_coef=0.05",
        f"+verl_ext.trace.dir={out / 'trace'}",  # verl's own config has no verl_ext node
        *merge_overrides(UPDATE_OVERRIDES, GPU_WORLD_OVERRIDES),  # with PRECISION=bf16: verl's GPU settings
        # responses cut at the length limit bootstrap from V(s_L), which verl's V1 trainer computes and drops
        "+algorithm.truncation=bootstrap",
        f"data.max_response_length={CUT_AT}",
        "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES='tests.e2e.v1_capture,my_estimators'",
        f"+ray_kwargs.ray_init.runtime_env.env_vars.VERL_EXT_TEST_CAPTURE_DIR='{capture}'",
        "trainer.save_freq=1",  # a checkpoint after every step, for verl-ext replay with the model
        *(f"algorithm.rollout_correction.{key}='{value}'" for key, value in CORRECTION.items()),
        *ray_cluster.v1_overrides,
    ]
    env = {
        **os.environ, **user, "PYTHON": sys.executable, "OUTPUT_DIR": str(out), "VERL_EXT_CPU_ASSETS": str(assets_dir),
        "V1": "1", "PRECISION": "bf16", "ESTIMATOR": "td_half", "STEPS": str(STEPS), "RAY_ADDRESS": ray_cluster.address,
    }  # fmt: skip
    # issue 43: the user's module sits in the directory the recipe is started from, as docs/estimators.md has it; only
    # the suite's own capture module is on PYTHONPATH (the recipe puts that directory first, for every process)
    env["PYTHONPATH"] = str(ROOT)
    completed = run(["bash", str(RECIPE), *overrides], env, out / "user", timeout=600)
    (out / "output.log").write_text(completed.stdout + completed.stderr)
    return out


def test_the_recipe_reports_progress_and_where_its_outputs_are(v1_run):
    progress = (v1_run / "output.log").read_text()
    assert f"[step {STEPS}/{STEPS}]" in progress and str(v1_run) in progress
    log = (v1_run / "train.log").read_text()  # verl's full output
    assert "(TaskRunnerV1 pid=" in log and "hf-generate/replica-0" in log  # V1 trainer, hf rollout


def test_verls_own_config_and_a_users_estimator_train_with_the_critic(v1_run):
    from verl_ext.apps.learning import read_metrics

    from tests.cpu.helpers import assert_trained

    assert_trained(read_metrics(v1_run), STEPS)  # critic values and critic updates at every step


def test_v1_live_metrics_equal_the_traces_numbers(v1_run):
    """verl's own config (no verl_ext node): the live metrics are on by default."""
    from tests.e2e.test_fit_with_trace import assert_live_metrics_equal_the_trace

    assert_live_metrics_equal_the_trace(v1_run, "td_half")


def test_v1_run_record(v1_run):
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(v1_run / "trace"))
    assert trace.record.trainer == "v1"
    assert trace.steps == [1, 2]
    # issue 59: what the HF-generate server (a Ray actor here) computed in on this CPU (its docstring's rule),
    # asked of it when the trace opened, not the config's rollout.dtype (verl's default, bfloat16)
    assert trace.record.rollout["name"] == "hf_generate" and trace.record.rollout["dtype"] == "float64"
    assert [trace.step_record(s).kl_coef for s in trace.steps] == [pytest.approx(0.05)] * 2


def test_v1_trace_equals_what_the_actor_update_read(v1_run):
    from tests.e2e.test_fit_with_trace import assert_the_correction_is_verls
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(v1_run / "trace"))
    columns = {"score": "rm_scores", **VERL_BATCH_KEYS}
    rejected = 0
    for step in trace.steps:
        used = torch.load(v1_run / "captured" / f"step{step}.pt")
        table = trace.read_step(step).to_pandas()
        mask = used["response_mask"].numpy()
        assert table["sample"].nunique() == mask.shape[0]
        positions = (table["sample"].to_numpy(), table["token_index"].to_numpy())
        assert (table["mask"].to_numpy() == (mask[positions] != 0)).all()
        assert (table["token_id"].to_numpy() == used["responses"].numpy()[positions]).all()
        own = (np.arange(mask.shape[1]) < used["response_length"].numpy()[:, None]).astype(mask.dtype)  # the policy's tokens
        assert_the_correction_is_verls(used, own, table, positions, CORRECTION)
        rejected += int(table["rejected"].sum())
        for column, key in columns.items():
            np.testing.assert_array_equal(table[column].to_numpy(np.float32), used[key].float().numpy()[positions])
        raw = (used["returns"] - used["values"]).numpy()[positions]
        np.testing.assert_allclose(table["advantage_raw"].to_numpy(), raw, rtol=1e-5, atol=1e-6)
        assert not np.allclose(table["reward"], table["score"]) or step == 1  # actor == reference at step 1
    assert rejected > 0  # the rejection took tokens out (at the median gap, 2e-3, few; not none over two steps)


def test_v1_cut_responses_bootstrap_from_the_value_after_their_last_token(v1_run):
    """td_half is GAE(γ, λ = 0.5): its returns against the direct sums with V_L = the recorded
    bootstrap_value on exactly the cut responses (docs/definitions.md #truncated-responses)."""
    import tests.support.reference as ref
    from verl_ext.trace.reader import open_trace

    from tests.e2e.test_fit_with_trace import cut_at_the_limit_rows

    trace = open_trace(str(v1_run / "trace"))
    assert trace.record.algorithm["truncation"] == "bootstrap"
    gamma = trace.record.algorithm["gamma"]  # verl's default: the run sets none
    cut_counts = []
    for step in trace.steps:
        used = torch.load(v1_run / "captured" / f"step{step}.pt")
        mask = used["response_mask"].numpy()
        cut = cut_at_the_limit_rows(used)
        cut_counts.append(int(cut.sum()))
        prompts = trace.prompts(step).to_pandas()
        assert prompts["truncated"].tolist() == cut.tolist()
        v_last = prompts["bootstrap_value"].to_numpy(np.float64)
        assert np.isnan(v_last[~cut]).all() and np.isfinite(v_last[cut]).all()
        rewards, values = used["token_level_rewards"].double().numpy(), used["values"].double().numpy()
        advantages = ref.gae_advantages(rewards, values, mask, gamma, 0.5, np.where(cut, v_last, 0.0))
        valid = mask != 0
        returns = used["returns"]
        # the returns as verl stored them: in bf16 on the V1 trainer's GPU settings, to its rounding
        tolerance = 2.0**-8 if returns.dtype == torch.bfloat16 else 1e-5
        np.testing.assert_allclose(returns.double().numpy()[valid], (advantages + values)[valid], rtol=tolerance, atol=tolerance)
    assert 0 < sum(cut_counts), cut_counts


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
        # verl's V1 trainer divides a mini-batch's token sum by its loss_mask's tokens, which its rollout set to the
        # response mask before the rollout correction's rejection (verl/trainer/ppo/v1/agent_loop_tq.py:199): the
        # policy's own tokens, the rejected ones with the kept, so every epoch's denominators add up to them
        for kind, table, key, half in (("actor", actor, "pg_loss", 1.0), ("critic", critic, "vf_loss", 0.5)):
            minibatches = trace.update_record(kind, step).minibatches
            for epoch in {m["epoch"] for m in minibatches}:
                assert sum(m["batch_num_tokens"] for m in minibatches if m["epoch"] == epoch) == used["response_length"].sum()
            sums = table.groupby(["epoch", "minibatch"])[key].sum()
            loss = half * np.mean([sums.get((m["epoch"], m["minibatch"]), 0.0) / m["batch_num_tokens"] for m in minibatches])
            assert loss == pytest.approx(metrics[step][f"{kind}/{key}"], rel=1e-5, abs=1e-7)


def test_the_run_is_in_verls_gpu_settings_and_its_trace_holds_the_bf16_numbers_it_used(v1_run):
    from tests.e2e.gpu_world import assert_gpu_world

    assert_gpu_world(v1_run, v1_run / "trace")


def test_v1_replay_as_recorded_reproduces_the_update(v1_run, tmp_path):
    """``verl-ext replay`` on the V1 trainer's trace (bf16, packed, dynamic batch size; its update went
    through TransferQueue): with the model, step 2 from verl's checkpoint of step 1 is REPRODUCED (update
    tables and parameters after the step), and so is its first mini-batch model-free; the model replay's
    trace passes the checker (the user's estimator importable, as in the run)."""
    from tests.e2e.test_fit_with_trace import user_module_env

    env = {**os.environ, **user_module_env(v1_run)}
    out = tmp_path / "replay"
    for mode, written in ((["--model-free"], []), ([], ["--out", str(out)])):  # the Ray group's time: one trace checked
        result = subprocess.run(
            [sys.executable, "-m", "verl_ext.cli", "replay", str(v1_run / "trace"), "--step", "2", *mode, *written],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        assert result.returncode == 0 and "as recorded: REPRODUCED" in result.stdout, result.stdout + result.stderr
        assert mode or "with the model" in result.stdout
    check = subprocess.run([sys.executable, "-m", "verl_ext.cli", "check", str(out), "--quiet"], capture_output=True, text=True, env=env)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-2000:]


def test_v1_replay_of_a_tighter_rejection_divides_by_the_policys_tokens_as_verls_v1_trainer(v1_run, tmp_path):
    """What-if a tighter token rejection (the run's chained one with the token bounds at 0.2%): the V1 trainer
    divides the loss by the policy's tokens, the rejected ones with the kept (docs/definitions.md#off-policy-tokens),
    so the first mini-batch's count is the recorded one with the model (verl's own update on the rebuilt batch)
    and model-free alike, while tokens were newly rejected there; the two replays' first mini-batches agree."""
    from tests.e2e.test_fit_with_trace import user_module_env
    from verl_ext.trace.reader import open_trace

    env = {**os.environ, **user_module_env(v1_run)}
    tighter = f"algorithm.rollout_correction.rollout_rs_threshold='0.998_1.002,{CORRECTION['rollout_rs_threshold'].split(',')[1]}'"
    written = {}
    for mode in ("model-free", "model"):
        written[mode] = tmp_path / mode
        flags = ["--model-free"] if mode == "model-free" else []
        result = subprocess.run(
            [sys.executable, "-m", "verl_ext.cli", "replay", str(v1_run / "trace"), "--step", "2", *flags, "--out", str(written[mode]), "--", tighter],
            capture_output=True, text=True, env=env,
        )  # fmt: skip
        assert result.returncode == 0 and "newly rejected" in result.stdout, result.stdout + result.stderr
    recorded = open_trace(str(v1_run / "trace"))
    count = {m["minibatch"]: m["batch_num_tokens"] for m in recorded.update_record("actor", 2).minibatches if m["epoch"] == 0}
    tables = {mode: open_trace(str(path)).actor_update(2).to_pandas() for mode, path in written.items()}
    first = tables["model"][(tables["model"]["epoch"] == 0) & (tables["model"]["minibatch"] == 0)].reset_index(drop=True)
    was = recorded.actor_update(2).to_pandas()
    assert len(first) < ((was["epoch"] == 0) & (was["minibatch"] == 0)).sum()  # tokens newly rejected in it
    for mode, path in written.items():
        minibatch = next(m for m in open_trace(str(path)).update_record("actor", 2).minibatches if (m["epoch"], m["minibatch"]) == (0, 0))
        assert minibatch["batch_num_tokens"] == count[0], mode
    for column in ("sample", "token_index", "ratio", "pg_loss", "advantage", "is_weight"):
        np.testing.assert_array_equal(tables["model-free"][column].to_numpy(), first[column].to_numpy(), err_msg=column)

"""recipes/cpu_demo.sh with verl 0.9's default V1 trainer (``V1=1``), verl's own ppo_trainer.yaml and the
README's example of a user's estimator (loaded in every process through VERL_USE_EXTERNAL_MODULES, as
docs/estimators.md runs it: the module in the directory the recipe is started from), on a local Ray cluster: the recipe reports progress and trains, the plugin
switches the critic on; the trace equals what the actor update read from TransferQueue (captured by
tests/e2e/v1_capture.py), its update tables cover every trained token once per epoch and reproduce
verl's logged metrics, the live metrics verl logged equal the trace's numbers, and it passes the checker;
in verl's GPU settings (bf16, packed, dynamic batch size); cut responses bootstrap from V(s_L);
with verl's rollout correction (sequence-level weights, two rejections chained) held to verl's own function,
replayed as recorded (with the model and model-free: REPRODUCED) and with a tighter rejection, as the V1 trainer
divides its loss. (The legacy trainer on Ray: tests/e2e/test_multinode.py.)

The run is the suite's one V1 run (tests/e2e/v1_run.py, the ``v1_run`` fixture of tests/e2e/conftest.py), which
tests/e2e/test_tool_on_ray.py reads too (issue 55: they were two runs): the tool task through verl's vLLM server,
multi-turn responses with holes where the tool answered, 4 responses per prompt. Where its configuration
differs from this file's own earlier run (the arith task on the HF-generate rollout), the test says what it
holds instead and why.

Covers: the V1 trainer's seam and hooks (verl_ext.integration: plugin, patches, validation,
trace_hook, update_hook, metrics_hook), verl_ext.registry with a user's estimator, verl_ext.trace
(capture, writer, reader), verl_ext.step_metrics, verl_ext.check.run through verl_ext.cli, verl_ext.apps.replay
on a V1 run, the recipe's progress report (verl_ext.apps.progress) and the CPU backend (verl_ext.cpu) on Ray."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.cpu.helpers import RAY_GROUP, VERL_BATCH_KEYS, rows_of_the_batch
from tests.e2e.v1_run import CORRECTION, KL_COEF, STEPS

pytestmark = pytest.mark.xdist_group(RAY_GROUP)  # one Ray run at a time, on the suite's cluster (tests/conftest.py)


def test_the_recipe_reports_progress_and_where_its_outputs_are(v1_run):
    progress = (v1_run / "output.log").read_text()
    assert f"[step {STEPS}/{STEPS}]" in progress and str(v1_run) in progress
    log = (v1_run / "train.log").read_text()  # verl's full output
    # V1 trainer; the rollout verl's vLLM server (the run's; it was verl-ext's HF-generate server, hf-generate/replica-0)
    assert "(TaskRunnerV1 pid=" in log and "(vLLMHttpServer pid=" in log and "hf-generate" not in log


def test_verls_own_config_and_a_users_estimator_train_with_the_critic(v1_run):
    from verl_ext.apps.learning import read_metrics

    from tests.cpu.helpers import assert_trained

    assert_trained(read_metrics(v1_run), STEPS, task="tool")  # critic values and critic updates at every step


def test_v1_live_metrics_equal_the_traces_numbers(v1_run):
    """verl's own config (no verl_ext node): the live metrics are on by default."""
    from tests.e2e.test_fit_with_trace import assert_live_metrics_equal_the_trace

    assert_live_metrics_equal_the_trace(v1_run, "td_half")


def test_v1_run_record(v1_run):
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(v1_run / "trace"))
    assert trace.record.trainer == "v1"
    assert trace.steps == [1, 2]
    # issue 59: the dtype the rollout engine computed in, asked of its server when the trace opened: verl's vLLM
    # server here, in the float32 the run set (PRECISION=bf16 alone gives it bfloat16; test_tool_on_ray.py holds its
    # log-probs to an fp32 forward pass). (The HF-generate server's own rule, float64 on this CPU where the config
    # says bfloat16, was this run's before it moved to vLLM; its Ray actor: tests/e2e/test_selftest.py.)
    assert trace.record.rollout["name"] == "vllm" and trace.record.rollout["dtype"] == "float32"
    assert [trace.step_record(s).kl_coef for s in trace.steps] == [pytest.approx(KL_COEF)] * 2


def test_v1_trace_equals_what_the_actor_update_read(v1_run):
    """The policy's own tokens, which verl's correction starts from, are the response mask verl's rollout wrote
    before the rejection (TransferQueue's ``loss_mask``, agent_loop_tq.py:199): on this multi-turn run the tool's
    messages are holes in it, so it is no longer every position up to the response's length (as on the single-turn
    run this test read before), and the turn check of assert_the_correction_is_verls counts the turns of it."""
    from tests.e2e.test_fit_with_trace import assert_the_correction_is_verls
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(v1_run / "trace"))
    columns = {"score": "rm_scores", **VERL_BATCH_KEYS}
    rejected = holes = 0
    for step in trace.steps:
        used = torch.load(v1_run / "captured" / f"step{step}.pt")
        table = trace.read_step(step).to_pandas()
        positions = rows_of_the_batch(table, used)
        own = used["loss_mask"].numpy()  # the policy's tokens, within each response's own length, holes among them
        length = used["response_length"].numpy()
        assert not (own * (np.arange(own.shape[1]) >= length[:, None])).any()
        holes += int((length - own.sum(1)).sum())  # the tool's messages, in the responses that called it
        assert_the_correction_is_verls(used, own, table, positions, CORRECTION)
        rejected += int(table["rejected"].sum())
        for column, key in columns.items():
            np.testing.assert_array_equal(table[column].to_numpy(np.float32), used[key].float().numpy()[positions])
        raw = (used["returns"] - used["values"]).numpy()[positions]
        np.testing.assert_allclose(table["advantage_raw"].to_numpy(), raw, rtol=1e-5, atol=1e-6)
        valid = table["mask"].to_numpy()
        # the KL is in the reward from step 2 (the actor is the reference at step 1); the tool's rewards are in it
        # at both steps (turn rewards), so the score alone no longer tells it: the score and the tool's reward
        expected = (table["score"] + table["tool_reward"]).to_numpy()[valid]
        assert not np.allclose(table["reward"].to_numpy()[valid], expected) or step == 1
    assert rejected > 0  # the rejection took tokens out (a fifth of the policy's tokens here; not none over two steps)
    assert holes > 0  # about 3 responses in 10 call the tool (tests/e2e/test_tool_on_ray.py)


def test_v1_cut_responses_bootstrap_from_the_value_after_their_last_token(v1_run):
    """td_half is GAE(γ, λ = 0.5): its returns against the direct sums with V_L = the recorded
    bootstrap_value on exactly the cut responses (docs/definitions.md #truncated-responses). The cut: the
    tool task's responses at tests/e2e/v1_run.py's CUT_AT, the tool tokenizer's EOS (the arith task's
    before); a multi-turn response's last valid token is its answer turn's, after the hole."""
    import tests.support.reference as ref
    from verl_ext.trace.reader import open_trace

    from tests.e2e.v1_run import cut_rows

    trace = open_trace(str(v1_run / "trace"))
    assert trace.record.algorithm["truncation"] == "bootstrap"
    gamma = trace.record.algorithm["gamma"]  # verl's default: the run sets none
    cut_counts = []
    for step in trace.steps:
        used = torch.load(v1_run / "captured" / f"step{step}.pt")
        mask = used["response_mask"].numpy()
        cut = cut_rows(used)
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
        # policy's own tokens, the rejected ones with the kept, so every epoch's denominators add up to them (on a
        # single-turn run each response's length; here the tool's messages are not the policy's: loss_mask's count)
        for kind, table, key, half in (("actor", actor, "pg_loss", 1.0), ("critic", critic, "vf_loss", 0.5)):
            minibatches = trace.update_record(kind, step).minibatches
            for epoch in {m["epoch"] for m in minibatches}:
                assert sum(m["batch_num_tokens"] for m in minibatches if m["epoch"] == epoch) == used["loss_mask"].sum()
            sums = table.groupby(["epoch", "minibatch"])[key].sum()
            loss = half * np.mean([sums.get((m["epoch"], m["minibatch"]), 0.0) / m["batch_num_tokens"] for m in minibatches])
            assert loss == pytest.approx(metrics[step][f"{kind}/{key}"], rel=1e-5, abs=1e-7)


def test_the_run_is_in_verls_gpu_settings_and_its_trace_holds_the_bf16_numbers_it_used(v1_run):
    from tests.e2e.gpu_world import assert_gpu_world

    assert_gpu_world(v1_run, v1_run / "trace")


def test_v1_replay_as_recorded_reproduces_the_update(v1_run, tmp_path):
    """``verl-ext replay`` on the V1 trainer's trace (bf16, packed, dynamic batch size; its update went
    through TransferQueue; a tool-task step, with holes where the tool answered): with the model, step 2 from
    verl's checkpoint of step 1 is REPRODUCED (the whole update: update tables and parameters after the step),
    and so is its first mini-batch model-free; the model replay's trace passes the checker (the user's estimator
    importable, as in the run). One model replay serves this file and tests/e2e/test_tool_on_ray.py, whose tool
    step it is (its what-if with another estimator is there)."""
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
    """What-if a tighter token rejection, model-free (the run's chained one, its token bounds at the median |ℓ| the
    first mini-batch kept, so that whatever this machine's gaps some of its tokens are newly rejected and about half
    of them stay: at half the largest, the single-turn run this test read before had every token of the step
    rejected, since its first mini-batch's largest |ℓ| was 3e-4 and the step's median larger; nothing left to whiten,
    exit 2): the V1
    trainer divides the loss by the policy's tokens, the rejected ones with the kept (as the update tables' test above
    finds verl does), so the first mini-batch's count stays the recorded one while it trains fewer tokens. (That the
    model replay divides as V1 does is what makes the as-recorded replay above REPRODUCED.)"""
    from tests.e2e.test_fit_with_trace import user_module_env
    from verl_ext.trace.reader import open_trace

    recorded = open_trace(str(v1_run / "trace"))
    was = recorded.actor_update(2).to_pandas()
    first_rows = was[(was["epoch"] == 0) & (was["minibatch"] == 0)]
    tokens = recorded.read_step(2).to_pandas().set_index(["sample", "token_index"])
    ell = (tokens["old_log_prob"] - tokens["rollout_log_prob"]).loc[list(zip(first_rows["sample"], first_rows["token_index"]))]
    gaps = np.abs(ell.to_numpy(np.float64))
    median = float(np.median(gaps))
    assert (gaps < median).any() and (gaps > median).any()  # a bf16 trainer and an fp32 rollout: gaps of every size
    # token_k1 keeps log l ≤ −ℓ ≤ log u (docs/definitions.md#off-policy-tokens): |ℓ| ≤ the median, within the run's 0.5%
    bounds = f"{float(np.exp(-median))!r}_{float(np.exp(median))!r}"  # Python's repr: numpy 2's reads np.float64(…)
    tighter = f"algorithm.rollout_correction.rollout_rs_threshold='{bounds},{CORRECTION['rollout_rs_threshold'].split(',')[1]}'"
    result = subprocess.run(
        [sys.executable, "-m", "verl_ext.cli", "replay", str(v1_run / "trace"), "--step", "2", "--model-free", "--out", str(tmp_path / "what-if"), "--", tighter],
        capture_output=True, text=True, env={**os.environ, **user_module_env(v1_run)},
    )  # fmt: skip
    assert result.returncode == 0 and "newly rejected" in result.stdout, result.stdout + result.stderr
    written = open_trace(str(tmp_path / "what-if"))
    rows = written.actor_update(2).to_pandas()
    assert 0 < len(rows) < len(first_rows)  # tokens newly rejected in the first mini-batch
    recorded_count = next(m for m in recorded.update_record("actor", 2).minibatches if (m["epoch"], m["minibatch"]) == (0, 0))
    replayed_count = next(m for m in written.update_record("actor", 2).minibatches if (m["epoch"], m["minibatch"]) == (0, 0))
    assert replayed_count["batch_num_tokens"] == recorded_count["batch_num_tokens"]

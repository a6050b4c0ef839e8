"""verl's real RayPPOTrainer.fit() in process (verl's own workers), asserted on what it trained on."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support import reference, tolerances
from tests.support.tolerances import assert_within
from tests.cpu.helpers import read_batches
from tests.e2e.test_fit_with_trace import GAMMA, LAM, TRUNCATION, cut_rows, fit_group, fit_run
from verl_ext.apps.learning import read_metrics


#: The runs are test_fit_with_trace's (made once per session, tests/support/shared_runs.py); each test here
#: is in its run's xdist group, so the worker that makes the run reads it.
GAE_RUN, GRPO_RUN = "gae+dynamic_bsz", "grpo"


@pytest.fixture(scope="module")
def gae_run(tmp_path_factory):
    """verl's gae with a critic and the KL penalty in the reward, 2 steps (micro-batches by token count),
    responses cut at the length limit left out of the whitening (algorithm.truncation=mask)."""
    return fit_run(tmp_path_factory, GAE_RUN)


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """verl's grpo: 8 prompts x 4 samples, no critic, 2 steps, responses cut at the length limit dropped
    from their groups (algorithm.truncation=mask)."""
    return fit_run(tmp_path_factory, GRPO_RUN)


def _valid(mask):
    return mask.bool()


@fit_group(GAE_RUN)
def test_each_step_reports_the_batch_it_trained_on(gae_run):
    steps = read_batches(gae_run)["steps"]
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        for key in ("responses", "response_mask", "token_level_scores", "token_level_rewards", "values",
                    "old_log_probs", "ref_log_prob", "advantages", "returns"):
            assert key in record, key
    assert sorted(read_metrics(gae_run)) == [0, 1, 2]  # 0: validation before training


@fit_group(GAE_RUN)
def test_one_agent_loop_serves_every_sample(gae_run):
    """The in-process agent-loop worker builds verl's single-turn agent loop once (verl: once per
    sample, through hydra) and runs it for every response, validation's included."""
    validation, training = 60, 2 * 8  # the held-out prompts once, then 2 steps of 8 prompts x 1 sample
    assert read_batches(gae_run)["agent_loops"] == {"built": 1, "runs": validation + training}


@fit_group(GAE_RUN)
def test_scores_sit_on_the_last_valid_token(gae_run):
    for record in read_batches(gae_run)["steps"].values():
        mask, scores = record["response_mask"], record["token_level_scores"]
        last = mask.sum(-1) - 1
        off_last = scores.clone()
        off_last[torch.arange(len(last)), last] = 0
        assert torch.all(off_last == 0)
        assert torch.all((scores.sum(-1) >= 0) & (scores.sum(-1) <= 1))


@fit_group(GAE_RUN)
def test_values_are_present_and_the_critic_trains(gae_run):
    steps = read_batches(gae_run)["steps"]
    for record in steps.values():
        values = record["values"][_valid(record["response_mask"])]
        assert torch.isfinite(values).all() and values.abs().sum() > 0
        # float32 and not bf16-quantised: some value is not a bf16 number (a proxy by counting distinct
        # values failed on a step whose 8 responses were one token each)
        assert values.dtype == torch.float32 and (values != values.to(torch.bfloat16).float()).any()
    metrics = read_metrics(gae_run)
    for step in (1, 2):
        assert np.isfinite(metrics[step]["critic/vf_loss"]) and metrics[step]["critic/grad_norm"] > 0
    # the mean predicted value moves between steps because the critic was updated in between
    assert metrics[1]["critic/values/mean"] != pytest.approx(metrics[2]["critic/values/mean"], abs=1e-4)


@fit_group(GAE_RUN)
def test_gae_returns_and_advantages_match_the_definition(gae_run):
    recorded = read_batches(gae_run)
    assert (recorded["gamma"], recorded["lam"]) == (GAMMA, LAM)
    for record in recorded["steps"].values():
        mask = record["response_mask"].numpy()
        rewards, values = record["token_level_rewards"].numpy(), record["values"].numpy()
        raw = reference.gae_advantages(rewards, values, mask, GAMMA, LAM)  # direct sum over δ
        valid = mask != 0
        # verl's float32 against these float64 sums, by docs/definitions.md#tolerances (tests/support/tolerances.py)
        lengths, magnitude = tolerances.per_row(mask, rewards, values, raw + values, raw)
        raw_error = tolerances.accumulated(raw, lengths, magnitude)
        assert_within(record["returns"].numpy()[valid], (raw + values)[valid], (raw_error + 4 * tolerances.EPS32 * np.abs(values))[valid], "returns")
        assert TRUNCATION["gae"] == "mask"  # whitened over the responses that were not cut; 0 on the cut ones
        cut = cut_rows(record, "gae")[:, None]
        rest = mask * ~cut  # at lr 1e-2 every response of step 2 may be cut: nothing to whiten
        raw = np.where(valid, raw, 0)
        whitened = np.where(cut, 0.0, reference.whiten(raw, rest)) if rest.any() else np.zeros_like(raw)
        if rest.sum() > 1:  # the raw advantage's rounding whitened, and the whitening's
            sigma = np.sqrt(raw[rest != 0].var(ddof=1) + 1e-8)
            tolerance = tolerances.whitened(whitened, tolerances.whitening_operands(raw, rest, raw + values, values)) + raw_error / sigma
        else:
            tolerance = np.full(raw.shape, tolerances.ATOL)
        assert_within(record["advantages"].numpy()[valid], whitened[valid], tolerance[valid], "advantages")


@fit_group(GAE_RUN)
def test_kl_in_reward_makes_rewards_differ_from_scores(gae_run):
    steps = read_batches(gae_run)["steps"]
    for step, record in steps.items():
        mask = record["response_mask"]
        kld = (record["old_log_probs"] - record["ref_log_prob"]) * mask  # algorithm.kl_penalty=kl
        expected = record["token_level_scores"] - record["kl_coef"] * kld
        torch.testing.assert_close(record["token_level_rewards"], expected, atol=1e-6, rtol=0)
    # step 1: the actor still equals the reference, so the penalty is 0; after one update it is not
    assert not torch.equal(steps[2]["token_level_rewards"], steps[2]["token_level_scores"])


@fit_group(GRPO_RUN)
def test_grpo_advantages_match_the_group_normalised_score(grpo_run):
    steps = read_batches(grpo_run)["steps"]
    assert sorted(steps) == [1, 2]
    for step, record in steps.items():
        assert "values" not in record  # no critic for grpo
        scores = record["token_level_rewards"].sum(-1).double()
        expected = torch.empty_like(scores)
        uids = np.array(record["uid"])
        assert len(set(uids)) == 8 and all((uids == uid).sum() == 4 for uid in set(uids))
        assert TRUNCATION["grpo"] == "mask"  # a cut response is dropped from its group and gets 0
        cut = cut_rows(record, "grpo")
        assert step > 1 or 0 < cut.sum() < len(cut)  # step 1 (the starting policy) cuts most responses, not all
        expected[torch.from_numpy(cut)] = 0.0
        for uid in set(uids):
            group = torch.from_numpy((uids == uid) & ~cut)
            if group.sum() == 1:  # verl's group of one: mean 0, std 1
                expected[group] = scores[group] / (1 + 1e-6)
            elif group.sum() > 1:
                expected[group] = (scores[group] - scores[group].mean()) / (scores[group].std() + 1e-6)
        mask = _valid(record["response_mask"])
        advantages = record["advantages"]
        # verl's float32 (G − mean)/(std + 1e-6), a whitening of sums of L rewards within each group:
        # docs/definitions.md#tolerances' whitening rule, the sums' rounding (ε·L·max|r|) among the operands
        lengths, magnitude = tolerances.per_row(record["response_mask"], record["token_level_rewards"])
        bound = np.full(len(scores), tolerances.ATOL)  # a cut response: 0
        for uid in set(uids):
            group = (uids == uid) & ~cut
            members = scores.numpy()[group]
            if len(members) > 1:
                scale = members.std(ddof=1) + 1e-6
                operands = np.abs(members) + abs(members.mean()) + (lengths * magnitude)[group, 0]
                bound[group] = tolerances.whitened(expected.numpy()[group], operands / scale)
            elif len(members) == 1:  # a group of one: G / (1 + 1e-6), one float32 sum
                bound[group] = tolerances.accumulated(expected.numpy()[group], lengths[group, 0], magnitude[group, 0])
        assert_within(advantages.numpy(), (expected[:, None] * mask).numpy(), np.where(mask.numpy(), bound[:, None], tolerances.ATOL), "grpo advantages")

"""Per-turn rewards (verl_ext.turn_rewards, docs/definitions.md §7): the seam at verl's own
compute_advantage, in-process, with the legacy trainer's fit() stand-in of test_nonfinite_seam.py
(the pure placement: tests/test_turn_rewards.py). Every expected reward is placed by hand below;
the estimators' outputs are held to tests/support/reference.py's direct sums and to verl's own grpo on those
rewards."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import tests.support.reference as ref
from tests.integration.test_nonfinite_seam import ROWS, STEP, data_proto, legacy_step, make_step
from verl_ext.integration import patches
from verl_ext.integration.agent_turns import TURNS_KEY

#: make_step's rows: turn 0 is tokens 0-2, a hole at 3-4, turn 1 from 5 to the row's end.
LENGTHS = (12, 8, 6, 10, 7, 12)
TURN_SCORES = [[0.2, 0.3], [], [0.5], [], [], [0.1, 0.2, 0.7]]  # row 5's third turn does not exist
TOOL_REWARDS = [[0.1], [0.1, 0.05], [], [0.1], [0.1], []]
TOOL_REWARD_TURNS = [[0], [0, 1], [], None, [0], []]  # row 3: the record could not pair its reward


def expected_added() -> torch.Tensor:
    added = torch.zeros(ROWS, 12)
    added[0, 2], added[0, 11] = 0.1 + 0.2, 0.3
    added[1, 2], added[1, 7] = 0.1, 0.05
    added[2, 2] = 0.5
    added[4, 2] = 0.1
    added[5, 2], added[5, 11] = 0.1, 0.2  # turn scores
    return added


def run_legacy_step(compose, estimator, *overrides, rejected=()):
    """The seam's step; ``rejected``: (row, token) pairs verl's rollout correction takes out of the response mask
    first (through the touch verl-ext puts on its correction, step.rollout_corrected)."""
    from verl_ext.integration import step

    config = compose(f"algorithm.adv_estimator={estimator}", "algorithm.gamma=1.0", "algorithm.lam=1.0", *overrides)
    batch = data_proto(make_step())
    batch.non_tensor_batch |= {
        "turn_scores": np.array(TURN_SCORES, dtype=object),
        "tool_rewards": np.array(TOOL_REWARDS, dtype=object),
        TURNS_KEY: np.array([None if t is None else {"tool_reward_turns": t} for t in TOOL_REWARD_TURNS], dtype=object),
    }
    trainer = SimpleNamespace(config=config, global_steps=STEP, batch=batch)

    def correct():  # what verl's correction does to the batch: a new response mask, without the rejected tokens
        kept = batch.batch["response_mask"].clone()
        for row, token in rejected:
            kept[row, token] = 0
        batch.batch["response_mask"] = kept
        return batch, {}

    def fit(self):
        if rejected:
            step.rollout_corrected(batch, correct)
        result.update(batch=legacy_step(self), metrics=step.take_metrics())

    result = {}
    patches.wrap_legacy_fit(fit)(trainer)
    return result["batch"], result["metrics"]


@pytest.mark.parametrize("estimator", ["mc", "grpo"])
def test_the_seam_adds_them_before_the_estimator(compose, estimator):
    scores = make_step()["token_level_scores"]
    batch, metrics = run_legacy_step(compose, estimator, "verl_ext.turn_rewards=true")
    rewards = scores + expected_added()
    torch.testing.assert_close(batch.batch["token_level_rewards"], rewards)
    torch.testing.assert_close(batch.batch["token_level_scores"], scores)  # verl's scores stay the final score
    mask = batch.batch["response_mask"]
    if estimator == "mc":
        for b in range(ROWS):
            idx = torch.nonzero(mask[b]).flatten()
            expected_returns = ref.mc_row(rewards[b, idx].tolist(), 1.0)
            np.testing.assert_allclose(batch.batch["returns"][b, idx].numpy(), expected_returns, rtol=1e-6, atol=1e-6)
    else:
        from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

        advantages, _ = compute_grpo_outcome_advantage(rewards, mask, batch.non_tensor_batch["uid"])
        torch.testing.assert_close(batch.batch["advantages"], advantages)
    assert metrics["verl_ext/turn_rewards/turn_score"] == pytest.approx((0.5 + 0.5 + 0.3) / ROWS)
    assert metrics["verl_ext/turn_rewards/tool_reward"] == pytest.approx((0.1 + 0.15 + 0.1) / ROWS)  # rows 0, 1, 4
    assert metrics["verl_ext/turn_rewards/unplaced"] == 2  # row 3's unpaired reward, row 5's third turn score


def test_a_token_verls_correction_rejected_is_no_hole(compose):
    """A rejected token is the policy's (docs/definitions.md#off-policy-tokens): the rewards sit on the turns' last
    tokens as without the rejection, on a rejected one too (row 0: token 1, inside turn 0, and token 11, turn 1's
    last; row 4: every token). On the mask after the rejection, row 0's turn 0 ended at token 0 and its turn 1 at 2
    (its rewards there, turn 1's at token 2) and row 4 had no turn (its tool reward unplaced): the suite's V1 run
    found it (tests/e2e/v1_run.py)."""
    rejected = [(0, 1), (0, 11), *[(4, t) for t in range(12)]]
    batch, metrics = run_legacy_step(compose, "mc", "verl_ext.turn_rewards=true", rejected=rejected)
    torch.testing.assert_close(batch.batch["token_level_rewards"], make_step()["token_level_scores"] + expected_added())
    assert metrics["verl_ext/turn_rewards/unplaced"] == 2  # row 3's unpaired reward, row 5's third turn score
    assert batch.batch["response_mask"][0, 1] == 0 and not batch.batch["response_mask"][4].any()  # rejected they stay


def test_off_by_default(compose):
    batch, metrics = run_legacy_step(compose, "mc")
    torch.testing.assert_close(batch.batch["token_level_rewards"], make_step()["token_level_scores"])
    assert not any(key.startswith("verl_ext/turn_rewards/") for key in metrics)


def test_a_bad_option_value_names_the_key(compose):
    with pytest.raises(ValueError, match="verl_ext.turn_rewards must be true or false"):
        run_legacy_step(compose, "mc", "verl_ext.turn_rewards=sometimes")

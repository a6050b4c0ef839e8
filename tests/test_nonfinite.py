"""Finding non-finite numbers on valid tokens and naming their first non-finite upstream quantity
(verl_ext.nonfinite), on hand-built tensors: one case per quantity, chains, masks, the fast check."""

from __future__ import annotations

import math
import re

import pytest
import torch

from verl_ext import nonfinite
from verl_ext.integration.nonfinite_hook import QUANTITIES
from verl_ext.nonfinite import find

NAN, INF = float("nan"), float("inf")
UID = ["u0", "u0", "u1", "u1"]


def step_tensors():
    """A finite step of 4 responses × 6 tokens: lengths 6, 4, 5, 3, an interior hole at (2, 1)."""
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]])
    g = torch.Generator().manual_seed(0)
    scores = torch.zeros(4, 6)
    scores[0, 5], scores[1, 3], scores[2, 4], scores[3, 2] = 1.0, 0.0, 0.4, 1.0
    tensors = {name: torch.randn(4, 6, generator=g) for name in ("values", "old_log_probs", "ref_log_prob", "rollout_log_probs")}
    tensors["token_level_scores"] = scores
    tensors["token_level_rewards"] = scores  # no KL in the reward: verl stores the same tensor twice
    tensors["returns"] = torch.randn(4, 6, generator=g)
    tensors["advantages"] = torch.randn(4, 6, generator=g)
    tensors["rollout_is_weights"] = torch.rand(4, 6, generator=g) + 0.5
    return tensors, mask


def test_a_finite_step_is_no_finding():
    tensors, mask = step_tensors()
    assert find(tensors, mask) is None


def test_non_finite_numbers_at_masked_positions_are_no_finding():
    tensors, mask = step_tensors()
    for name in QUANTITIES:
        tensors[name] = tensors[name].clone()
        tensors[name][mask == 0] = NAN
    tensors["values"][1, 5] = INF
    assert find(tensors, mask) is None


@pytest.mark.parametrize(
    "quantity, where, value",
    [
        ("advantages", (2, 3), NAN),
        ("returns", (0, 0), INF),
        ("token_level_rewards", (3, 1), -INF),
        ("values", (1, 2), NAN),
        ("old_log_probs", (2, 4), -INF),
        ("ref_log_prob", (0, 5), NAN),
        ("rollout_log_probs", (1, 0), -INF),
        ("rollout_is_weights", (3, 2), INF),
    ],
)
def test_each_quantity_alone_is_named_with_its_sample_uid_and_token(quantity, where, value):
    tensors, mask = step_tensors()
    tensors[quantity] = tensors[quantity].clone()  # rewards: no longer the scores' tensor
    tensors[quantity][where] = value
    finding = find(tensors, mask)
    assert list(finding.spots) == [quantity]
    spot = finding.spots[quantity]
    assert (spot.count, spot.row, spot.token) == (1, *where)
    row, token = where
    shown = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    assert finding.line(step=12, uid=UID) == (
        f"verl-ext: step 12: {quantity} not finite on 1 of 17 valid tokens, first {shown} at sample {row} "
        f"(uid {UID[row]}), token {token}; nothing upstream of it is non-finite"
    )


def test_a_nan_value_that_made_every_advantage_nan_is_named_as_the_value():
    """The issue's example: NaN in values at sample 3, token 1; mc with whitening makes every advantage NaN."""
    tensors, mask = step_tensors()
    tensors["values"][3, 1] = NAN
    tensors["advantages"] = torch.full((4, 6), NAN)
    line = find(tensors, mask).line(step=7, uid=UID)
    assert line == (
        "verl-ext: step 7: advantages not finite on 17 of 17 valid tokens, first nan at sample 0 (uid u0), token 0; "
        "first non-finite upstream: values, nan at sample 3 (uid u1), token 1 (1 valid token)"
    )
    assert "\n" not in line


def test_a_nan_score_is_followed_through_the_rewards_and_other_quantities_are_listed():
    tensors, mask = step_tensors()
    tensors["token_level_scores"][2, 4] = NAN  # also the rewards: the same tensor
    tensors["returns"][2, :5] = NAN
    tensors["advantages"] = torch.full((4, 6), NAN)
    tensors["rollout_log_probs"][0, 2] = -INF
    finding = find(tensors, mask)
    assert [spot.quantity for spot in finding.cause()] == ["advantages", "token_level_rewards", "token_level_scores"]
    assert finding.line(step=3, uid=UID) == (
        "verl-ext: step 3: advantages not finite on 17 of 17 valid tokens, first nan at sample 0 (uid u0), token 0; "
        "first non-finite upstream: token_level_scores (via token_level_rewards), nan at sample 2 (uid u1), token 4 "
        "(1 valid token); also not finite: returns (4 valid tokens, first nan at sample 2 (uid u1), token 0), "
        "rollout_log_probs (1 valid token, first -inf at sample 0 (uid u0), token 2)"
    )


def test_kl_in_the_reward_names_the_log_prob_behind_a_non_finite_reward():
    tensors, mask = step_tensors()
    tensors["token_level_rewards"] = tensors["token_level_scores"].clone()
    tensors["ref_log_prob"][1, 1] = -INF
    tensors["token_level_rewards"][1, 1] = INF  # r = score − β (old − ref)
    line = find(tensors, mask).line(step=4, uid=UID)
    assert line.startswith("verl-ext: step 4: token_level_rewards not finite on 1 of 17 valid tokens, first inf at sample 1")
    assert line.endswith("; first non-finite upstream: ref_log_prob, -inf at sample 1 (uid u0), token 1 (1 valid token)")


def test_a_nan_rollout_log_prob_behind_a_nan_importance_weight_is_named():
    """verl's rollout correction computes the weight from exp(log π_old − log π_rollout): a NaN there is the weight's cause."""
    tensors, mask = step_tensors()
    tensors["rollout_log_probs"][1, 2] = NAN
    tensors["rollout_is_weights"][1, 2] = NAN
    line = find(tensors, mask).line(step=5, uid=UID)
    assert line.startswith("verl-ext: step 5: rollout_is_weights not finite on 1 of 17 valid tokens, first nan at sample 1")
    assert line.endswith("; first non-finite upstream: rollout_log_probs, nan at sample 1 (uid u0), token 2 (1 valid token)")


def test_returns_from_a_non_finite_reward_and_a_non_finite_value_name_the_reward_first():
    tensors, mask = step_tensors()
    tensors["token_level_scores"][1, 3] = NAN
    tensors["values"][0, 0] = NAN
    tensors["returns"][1, :4] = NAN
    finding = find({k: v for k, v in tensors.items() if k != "advantages"}, mask)
    assert finding.reported.quantity == "returns"
    assert [s.quantity for s in finding.cause()] == ["returns", "token_level_rewards", "token_level_scores"]
    assert re.search(r"also not finite: values \(1 valid token, first nan at sample 0 \(uid u0\), token 0\)$", finding.line(1, UID))


def test_missing_quantities_other_shapes_and_integer_tensors_are_ignored():
    tensors, mask = step_tensors()
    assert find({"values": tensors["values"], "advantages": None, "responses": torch.zeros(4, 6, dtype=torch.long)}, mask) is None
    wrong_shape = torch.full((4, 7), NAN)
    assert find({"values": wrong_shape}, mask) is None
    tensors["values"][0, 0] = NAN
    finding = find({"values": tensors["values"]}, mask)
    assert finding.line(step=None) == (
        "verl-ext: step ?: values not finite on 1 of 17 valid tokens, first nan at sample 0 (uid ?), token 0; "
        "nothing upstream of it is non-finite"
    )


def test_a_score_is_read_only_to_name_a_cause():
    """A non-finite score whose reward is finite (impossible in verl) is not reported on its own."""
    tensors, mask = step_tensors()
    tensors["token_level_rewards"] = tensors["token_level_scores"].clone()
    tensors["token_level_scores"][0, 1] = NAN
    assert find(tensors, mask) is None


def test_the_fast_check_reads_each_tensor_once_and_sees_every_kind_of_non_finite():
    x = torch.randn(3, 5)
    assert nonfinite.all_finite([x, x, x.clone()])
    for bad in (NAN, INF, -INF):
        y = x.clone()
        y[2, 4] = bad
        assert not nonfinite.all_finite([x, y])
    both = x.clone()
    both[0, 0], both[1, 1] = INF, -INF  # +inf and -inf: the sum is nan
    assert not nonfinite.all_finite([both])
    assert not nonfinite.all_finite([x.to(torch.bfloat16), y.double()])
    sums = []
    original = torch.Tensor.sum
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "sum", lambda self, *a, **k: sums.append(self.data_ptr()) or original(self, *a, **k))
        nonfinite.all_finite([x, x, x[:, :2]])
    assert len(sums) == 2  # the same tensor under two names is read once; a view of it is another tensor

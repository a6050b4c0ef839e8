"""The live metrics' formulas (verl_ext.step_metrics) against docs/definitions.md §9 written as
direct sums (tests/support/reference.py), and by hand."""

from __future__ import annotations

import numpy as np
import pytest

import tests.support.reference as ref
from verl_ext.step_metrics import Responses, critic_by_group, credit_shares, prefixed, step_metrics
from verl_ext.turns import turn_starts


def padded_step(seed: int):
    """(B, T) rewards, values, raw advantage, advantage, scores, mask and uids: lengths 1 … 23 with
    interior holes, one response without valid tokens, groups of 1 to 3 responses."""
    rng = np.random.default_rng(seed)
    B, T = 40, 24  # enough responses for every bucket to hold MIN_EV_TOKENS tokens
    lengths = rng.integers(1, T, size=B)
    lengths[:3] = (1, 3, 10)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.int64)
    mask[3:, 4:6] = 0
    mask[3:, 0] = 1
    mask[5] = 0  # nothing valid
    values = rng.normal(size=(B, T)) + 2.0  # a mean far from 0: the variances must keep their digits
    rewards = np.where(mask == 1, rng.normal(size=(B, T)), 0.0)
    scores = np.where(mask == 1, rng.normal(size=(B, T)), 0.0)
    raw = rng.normal(size=(B, T))
    advantages = rng.normal(size=(B, T))
    uid = [f"u{b // 3}" for b in range(B - 1)] + ["alone"]
    return rewards, values, raw, advantages, scores, mask, uid


def compacted(x, mask):
    return np.asarray(x, np.float64)[np.asarray(mask) != 0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_against_the_direct_sums(seed):
    gamma = 0.9
    rewards, values, raw, advantages, scores, mask, uid = padded_step(seed)
    lengths = mask.sum(1)
    g = compacted(ref.mc_returns(rewards, mask, gamma), mask)
    has = lengths > 0
    starts = compacted(turn_starts(mask), mask) > 0
    got = step_metrics(
        Responses.of(lengths, starts), returns=g, values=compacted(values, mask), advantage_raw=compacted(raw, mask),
        advantage=compacted(advantages, mask), scores=(scores * mask).sum(1)[has], uid=np.array(uid)[has],
    )  # fmt: skip
    want = ref.live_metrics(rewards, values, raw, advantages, scores, mask, uid, gamma)
    # the hole at 4-5 of rows 3+: two turns, so turn0, turn1, after_hole and two turn shares
    assert sorted(got) == sorted(want) and len(want) == 18 + 5
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_without_values_there_are_no_critic_metrics():
    rewards, values, raw, advantages, scores, mask, uid = padded_step(3)
    got = step_metrics(
        Responses.of(mask.sum(1)), returns=None, values=None, advantage_raw=compacted(advantages, mask),
        advantage=compacted(advantages, mask),
    )  # fmt: skip
    assert sorted(got) == ["adv/raw_std", "adv/whiten_mean", "adv/whiten_std", "credit/first_half_share", "credit/top_token_share"]
    assert sorted(prefixed(got))[0] == "verl_ext/adv/raw_std"


def test_credit_by_hand():
    # response 0: |A| = [1, 1, 1, 1] (even: top share 1/4, first half 2 of 4);
    # response 1: |A| = [0, 0, 3] (one token: top share 1, first half = rank 0 and 1, 0 of 3);
    # response 2: all zero, no share of its own
    a = np.array([1.0, -1, 1, -1, 0, 0, -3, 0, 0])
    shares = credit_shares(a, Responses.of([4, 3, 2]))
    assert shares["top_token_share"] == pytest.approx((0.25 + 1.0) / 2)
    assert shares["first_half_share"] == pytest.approx(2 / 7)
    assert credit_shares(np.zeros(3), Responses.of([3])) == {"top_token_share": None, "first_half_share": None}


def test_a_return_that_does_not_vary_has_no_explained_variance():
    g = np.full(5, 0.1 + 0.2)  # not exactly representable: shifting must not invent a variance
    rows = critic_by_group(np.arange(5.0), g, np.zeros(5, np.int64), 2)
    assert rows[0]["explained_var"] is None and rows[0]["tokens"] == 5
    assert rows[1] == {"tokens": 0, "explained_var": None, "mean_abs_error": None, "mean_return": None, "mean_value": None}


def test_the_group_std_does_not_depend_on_the_uids_names():
    """verl's uids are random: the same responses under other names (sorting in another order) give the
    same number to the last bit, so two runs of one seed log the same metrics."""
    from verl_ext.step_metrics import group_score_std

    scores = np.random.default_rng(3).random(64)
    groups = np.repeat(np.arange(16), 4)
    named = [f"{g:04d}" for g in groups]
    renamed = [f"{(15 - g) * 7919 % 9973:04d}-{g}" for g in groups]  # another sort order of the same groups
    assert np.argsort(np.unique(renamed, return_index=True)[1]).tolist() != list(range(16))
    assert group_score_std(scores, renamed) == group_score_std(scores, named)
    by_hand = np.mean([scores[groups == g].std(ddof=1) for g in range(16)])
    assert group_score_std(scores, named) == pytest.approx(by_hand, rel=1e-12)


def test_prompt_groups_are_numbered_in_order_of_first_appearance():
    from verl_ext.step_metrics import prompt_groups

    assert prompt_groups(["zeta", "alpha", "zeta", "mid", "alpha", "omega"]).tolist() == [0, 1, 0, 2, 1, 3]
    assert prompt_groups(np.array([7, 3, 7, 0, 9, 3])).tolist() == [0, 1, 0, 2, 3, 1]
    assert prompt_groups(["only"]).tolist() == [0]


def test_turns_by_hand():
    # response 0: valid tokens 0, 1 | hole | 2 (turns 0, 0, 1); response 1: tokens 3, 4 (one turn)
    from verl_ext.step_metrics import critic_by_turn, turn_shares

    responses = Responses.of([3, 2], [True, False, True, True, False])
    assert responses.turn.tolist() == [0, 0, 1, 0, 0] and responses.turns.tolist() == [2, 1] and responses.multi_turn
    g, v = np.array([1.0, 9, 0.5, 3.0, 9]), np.array([0.0, 9, 0.25, 2.0, 9])
    by_turn = critic_by_turn(v, g, responses)
    assert list(by_turn) == ["turn0", "turn1", "after_hole"]
    # turn0: the first tokens 0 and 3: G = [1, 3], V = [0, 2]: G − V = [1, 1] does not vary: EV = 1,
    # left blank in the bucket, which has 2 tokens, fewer than MIN_EV_TOKENS = 8
    (turn0,) = critic_by_group(v[[0, 3]], g[[0, 3]], np.zeros(2, np.int64), 1)
    assert turn0["explained_var"] == pytest.approx(1.0)
    assert by_turn["turn0"] == {**turn0, "explained_var": None} and by_turn["turn0"]["tokens"] == 2
    assert by_turn["turn1"] == by_turn["after_hole"] == {
        "tokens": 1, "explained_var": None, "mean_abs_error": 0.25, "mean_return": 0.5, "mean_value": 0.25,
    }  # fmt: skip
    assert turn_shares(np.array([1.0, -1, 2, 1, -1]), responses) == pytest.approx({"turn0": 4 / 6, "turn1": 2 / 6})
    assert not Responses.of([3, 2], [True, False, False, True, False]).multi_turn
    assert not Responses.of([3, 2]).multi_turn


@pytest.mark.parametrize("responses", [7, 8])
def test_a_bucket_needs_eight_tokens_for_its_explained_variance(responses):
    """Responses of one token each: d0, last and all hold one token a response. G alternates 0, 1
    and V = G/2, so G − V = G/2 and EV = 1 − Var(G)/4 / Var(G) = 0.75, shown from 8 tokens on
    (docs/definitions.md §9); the means are kept either way."""
    from verl_ext.step_metrics import critic_by_position

    g = np.arange(responses) % 2.0
    by_position = critic_by_position(g / 2, g, Responses.of([1] * responses))
    for bucket in ("d0", "last", "all"):
        stats = by_position[bucket]
        assert stats["tokens"] == responses
        assert stats["explained_var"] == (None if responses < 8 else pytest.approx(0.75)), bucket
        assert stats["mean_abs_error"] == pytest.approx(g.sum() / 2 / responses)
    got = step_metrics(Responses.of([1] * responses), returns=g, values=g / 2, advantage_raw=None, advantage=None)
    assert ("critic/ev_mc/d0" in got) == ("critic/ev_mc_last" in got) == (responses >= 8)

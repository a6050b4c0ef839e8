"""algorithm.truncation (docs/definitions.md #truncated-responses), pure: which responses are cut, and the
three treatments of every estimator against tests/support/reference.py's direct sums with V_L (the value after
the last valid token) written into the sum, on rows with and without holes, cut and not cut, γ < 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tests.support.reference as ref
from verl_ext import registry
from verl_ext.options import TRUNCATION
from verl_ext.truncation import Truncation, cut_responses

EOS = 2
GAMMA, LAM = 0.9, 0.8
N_STEP, LAM_CRITIC, LAM_ACTOR = 3, 0.95, 0.6

# --------------------------------------------------------------------------- the cut, by hand


def test_cut_responses_by_hand():
    ids = torch.tensor(
        [
            [5, 6, 7, 8],  # reaches the limit on a word: cut
            [5, 6, 7, EOS],  # EOS at the limit: ended
            [5, 6, 0, 0],  # ended before the limit
            [5, 6, 7, 9],  # a hole at the end (position 3 masked): the last valid token is not at the limit
            [0, 0, 0, 0],  # no valid token
            [5, EOS, 7, 8],  # EOS inside a turn, a word at the limit: cut
            [5, 6, 7, 3],  # the second EOS id at the limit: ended
            [5, 0, 0, 8],  # a hole inside, a word at the limit: cut
        ]
    )
    mask = torch.tensor(
        [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 1]]
    )
    cut = cut_responses(ids, mask, (EOS, 3), max_response_length=4)
    assert cut.tolist() == [True, False, False, False, False, True, False, True]
    # a limit beyond the batch's width cuts nothing
    assert not cut_responses(ids, mask, (EOS,), max_response_length=5).any()


def test_the_option_is_one_of_three_values_in_one_line():
    assert TRUNCATION.read({}) == "terminal"
    assert [TRUNCATION.read({"truncation": mode}) for mode in ("terminal", "bootstrap", "mask")] == ["terminal", "bootstrap", "mask"]
    with pytest.raises(ValueError, match=r"^algorithm.truncation must be one of terminal, bootstrap, mask, got 'cut'$"):
        TRUNCATION.read({"truncation": "cut"})
    with pytest.raises(ValueError, match="needs V\\(s_L\\)"):
        Truncation("bootstrap", torch.zeros(2, dtype=torch.bool))


# --------------------------------------------------------------------------- the estimators under the three options


def make_batch():
    """Eight rows of width 10: cut rows (full length, with and without holes, several turns) and rows that
    ended (EOS at the limit, shorter, a hole at the end); V(s_L) on every row, read on the cut ones only."""
    g = torch.Generator().manual_seed(3)
    T = 10
    lengths = [10, 10, 10, 7, 10, 10, 4, 10]
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    mask[1, 3:5] = 0  # a hole: two turns
    mask[4, 2:3] = 0
    mask[4, 6:8] = 0  # three turns
    mask[5, 8:] = 0  # a hole at the end: its last valid token is not at the limit
    cut = torch.tensor([True, True, False, False, True, False, False, True])  # row 2 and 7 at the limit, 2 on EOS
    rewards = torch.randn(8, T, generator=g) * mask
    values = torch.randn(8, T, generator=g)
    v_l = torch.randn(8, generator=g)
    return rewards, values, mask, cut, v_l


def reference(name, rewards, values, mask, v_last):
    """(returns, raw advantage) from the direct sums, V_L = v_last[b] on row b (nan off the mask)."""
    r, v, m = rewards.double().numpy(), values.double().numpy(), mask.numpy()
    returns, raw = np.full(r.shape, np.nan), np.full(r.shape, np.nan)
    for b in range(r.shape[0]):
        idx = ref.valid_positions(m[b])
        rb, vb, vl = r[b, idx], v[b, idx], float(v_last[b])
        if name == "mc":
            returns[b, idx] = ref.mc_row(rb, GAMMA, vl)
        elif name == "td0":
            returns[b, idx] = ref.td0_row(rb, vb, GAMMA, vl)
        elif name == "nstep":
            returns[b, idx] = ref.nstep_row(rb, vb, GAMMA, N_STEP, vl)
        elif name == "gae":
            returns[b, idx] = ref.gae_row(rb, vb, GAMMA, LAM, vl) + vb
        else:  # gae_ext (λ_critic for the returns), turn_gae
            returns[b, idx] = ref.gae_row(rb, vb, GAMMA, LAM_CRITIC, vl) + vb
        if name == "gae_ext":
            raw[b, idx] = ref.gae_row(rb, vb, GAMMA, LAM_ACTOR, vl)
        elif name == "turn_gae":
            raw[b] = ref.turn_gae_row(r[b], v[b], m[b], GAMMA, LAM, vl)
        else:
            raw[b, idx] = returns[b, idx] - vb
    return returns, raw


ESTIMATORS = ("mc", "td0", "nstep", "gae", "gae_ext", "turn_gae")


def run(name, truncation, rewards, values, mask, whiten=None):
    estimator = registry.get(name)
    settings = estimator.settings(
        {"gamma": GAMMA, "lam": LAM, "n_step": N_STEP, "lam_critic": LAM_CRITIC, "lam_actor": LAM_ACTOR if name == "gae_ext" else None}
    )
    return registry.run(estimator, rewards, values, mask, settings, whiten=whiten, truncation=truncation)


def assert_on_mask(actual, expected, mask):
    valid = mask.bool().numpy()
    np.testing.assert_allclose(actual.double().numpy()[valid], expected[valid], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_bootstrap_uses_v_l_on_cut_rows_and_0_on_the_others(name):
    rewards, values, mask, cut, v_l = make_batch()
    result = run(name, Truncation("bootstrap", cut, v_l), rewards, values, mask)
    returns, raw = reference(name, rewards, values, mask, torch.where(cut, v_l, 0.0))
    assert_on_mask(result.returns, returns, mask)
    assert_on_mask(result.advantage_raw, raw, mask)
    assert_on_mask(result.advantages, ref.whiten(raw, mask), mask)
    # the bootstrap changes every cut row and no other
    terminal = run(name, None, rewards, values, mask)
    changed = ((result.returns - terminal.returns).abs() * mask).sum(-1) > 1e-6
    assert changed.tolist() == cut.tolist()


@pytest.mark.parametrize("name", ESTIMATORS)
def test_mask_zeroes_cut_rows_and_whitens_over_the_others(name):
    rewards, values, mask, cut, v_l = make_batch()
    result = run(name, Truncation("mask", cut), rewards, values, mask)
    returns, raw = reference(name, rewards, values, mask, np.zeros(len(mask)))  # the terminal ones
    kept = mask * ~cut[:, None]
    expected = np.where(cut.numpy()[:, None], 0.0, ref.whiten(raw, kept.numpy()))
    assert_on_mask(result.returns, returns, mask)
    assert_on_mask(result.advantage_raw, raw, mask)
    assert_on_mask(result.advantages, expected, mask)
    assert (result.advantages[cut] == 0).all()
    # unwhitened, the cut rows are still 0 and the others their raw advantage
    unwhitened = run(name, Truncation("mask", cut), rewards, values, mask, whiten=False)
    assert_on_mask(unwhitened.advantages, np.where(cut.numpy()[:, None], 0.0, raw), mask)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_terminal_is_the_run_without_the_option_bit_for_bit(name):
    rewards, values, mask, cut, v_l = make_batch()
    without = run(name, None, rewards, values, mask)
    for truncation in (Truncation("terminal", cut), Truncation("terminal", cut, v_l)):
        result = run(name, truncation, rewards, values, mask)
        for key in ("returns", "advantage_raw", "advantages"):
            assert torch.equal(getattr(result, key), getattr(without, key))
    returns, raw = reference(name, rewards, values, mask, np.zeros(len(mask)))
    assert_on_mask(without.returns, returns, mask)


def test_mask_with_every_response_cut_leaves_no_advantage():
    rewards, values, mask, _, _ = make_batch()
    result = run("gae_ext", Truncation("mask", torch.ones(len(mask), dtype=torch.bool)), rewards, values, mask)
    assert (result.advantages == 0).all()
    returns, _ = reference("gae_ext", rewards, values, mask, np.zeros(len(mask)))
    assert_on_mask(result.returns, returns, mask)


def test_mask_with_one_token_left_outside_the_cut_leaves_no_advantage():
    """σ needs two tokens: one response of one token left is no statistics (verl's masked_whiten raises)."""
    rewards, values, mask, _, _ = make_batch()
    mask = mask.clone()
    mask[0] = 0
    mask[0, 0] = 1  # row 0 keeps one valid token and is the only row not cut
    cut = torch.ones(len(mask), dtype=torch.bool)
    cut[0] = False
    result = run("gae_ext", Truncation("mask", cut), rewards, values, mask)
    assert (result.advantages == 0).all()


def test_bootstrap_rewards_add_gamma_v_l_on_the_last_valid_token_of_cut_rows_only():
    rewards, values, mask, cut, v_l = make_batch()
    bootstrapped = Truncation("bootstrap", cut, v_l).rewards(rewards, mask, GAMMA)
    added = bootstrapped - rewards
    for b in range(len(mask)):
        last = int(ref.valid_positions(mask[b])[-1])
        expected = torch.zeros(mask.shape[1])
        if cut[b]:
            expected[last] = GAMMA * v_l[b]
        torch.testing.assert_close(added[b], expected)

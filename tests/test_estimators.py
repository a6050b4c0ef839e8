"""The estimators against the definitions (docs/definitions.md §5), verl's own GAE, and hand calculation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import tests.support.reference as ref
from verl_ext import estimators as E
from verl_ext import kernels, registry
from verl_ext.steps.as_run import compared_settings
from verl_ext.options import LAM_CRITIC

settings.register_profile("verl_ext", max_examples=60, deadline=None)
settings.load_profile("verl_ext")


@st.composite
def batches(draw, max_rows=4, max_len=24, junk=float("nan")):
    """Rewards, values and a mask with trailing padding and interior holes; junk where masked."""
    rows = draw(st.integers(1, max_rows))
    length = draw(st.integers(1, max_len))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths = rng.integers(0, length + 1, size=rows)
    mask = (np.arange(length)[None, :] < lengths[:, None]).astype(np.int64)
    hole_rate = draw(st.sampled_from([0.0, 0.2, 0.5]))
    mask &= (rng.random((rows, length)) >= hole_rate).astype(np.int64)
    rewards = rng.normal(size=(rows, length))
    values = rng.normal(size=(rows, length))
    rewards[mask == 0] = junk
    values[mask == 0] = junk
    return (
        torch.tensor(rewards, dtype=torch.float32),
        torch.tensor(values, dtype=torch.float32),
        torch.tensor(mask),
    )


unit = st.floats(0.0, 1.0)


def estimate(rewards, values, mask, name, whiten_advantages=True, **algorithm):
    """verl-ext's estimator ``name`` through the registry, the code path of training."""
    estimator = registry.get(name)
    settings = estimator.settings({"whiten_advantages": whiten_advantages, **algorithm})
    return registry.run(estimator, rewards, values, mask, settings)


def mc_returns(rewards, mask, gamma):
    return E.mc(rewards, None, mask, gamma)[0]


def td0_returns(rewards, values, mask, gamma):
    return E.td0(rewards, values, mask, gamma)[0]


def nstep_returns(rewards, values, mask, gamma, n):
    return E.nstep(rewards, values, mask, gamma, n)[0]


def gae_advantages(rewards, values, mask, gamma, lam):
    return E.gae(rewards, values, mask, gamma, lam)[1]


def assert_valid_close(actual: torch.Tensor, expected, mask, tol=2e-4):
    valid = mask.numpy() != 0
    expected = np.asarray(expected, dtype=np.float64)
    scale = 1.0 + np.abs(expected[valid])
    np.testing.assert_array_less(np.abs(actual.double().numpy()[valid] - expected[valid]), tol * scale)


# --------------------------------------------------------------------------- against the direct sums


@given(batches(), unit)
def test_mc_returns_are_discounted_sums(batch, gamma):
    rewards, _, mask = batch
    assert_valid_close(mc_returns(rewards, mask, gamma), ref.mc_returns(rewards, mask, gamma), mask)


@given(batches(), unit)
def test_td0_returns(batch, gamma):
    rewards, values, mask = batch
    assert_valid_close(td0_returns(rewards, values, mask, gamma), ref.td0_returns(rewards, values, mask, gamma), mask)


@given(batches(), unit, st.integers(1, 30))
def test_nstep_returns(batch, gamma, n):
    rewards, values, mask = batch
    expected = ref.nstep_returns(rewards, values, mask, gamma, n)
    assert_valid_close(nstep_returns(rewards, values, mask, gamma, n), expected, mask)


@given(batches(), unit, unit)
def test_gae_advantages(batch, gamma, lam):
    rewards, values, mask = batch
    expected = ref.gae_advantages(rewards, values, mask, gamma, lam)
    assert_valid_close(gae_advantages(rewards, values, mask, gamma, lam), expected, mask)


@given(batches(), unit, st.data())
def test_gae_with_one_lambda_per_response(batch, gamma, data):
    rewards, values, mask = batch
    lams = data.draw(st.lists(unit, min_size=rewards.shape[0], max_size=rewards.shape[0]))
    expected = ref.gae_advantages(rewards, values, mask, gamma, np.array(lams))
    assert_valid_close(gae_advantages(rewards, values, mask, gamma, torch.tensor(lams)), expected, mask)


def test_long_undiscounted_float32_stays_accurate():
    """20k dense rewards at γ = 1: float32 result within 1e-6 relative of the float64 sums."""
    rewards = torch.rand(2, 20000)
    mask = torch.ones_like(rewards, dtype=torch.int64)
    expected = torch.flip(torch.cumsum(torch.flip(rewards.double(), [1]), 1), [1])
    actual = mc_returns(rewards, mask, 1.0).double()
    assert ((actual - expected).abs() / expected.abs()).max() < 1e-6


# --------------------------------------------------------------------------- identities (docs/definitions.md §5)


@given(batches(), unit)
def test_gae_lambda_zero_is_td0_and_lambda_one_is_mc(batch, gamma):
    rewards, values, mask = batch
    td0_adv = td0_returns(rewards, values, mask, gamma) - values
    mc_adv = mc_returns(rewards, mask, gamma) - values
    assert_valid_close(gae_advantages(rewards, values, mask, gamma, 0.0), td0_adv.double().numpy(), mask)
    assert_valid_close(gae_advantages(rewards, values, mask, gamma, 1.0), mc_adv.double().numpy(), mask)


@given(batches(), unit)
def test_nstep_one_is_td0_and_long_nstep_is_mc(batch, gamma):
    rewards, values, mask = batch
    longest = rewards.shape[1]
    td0 = td0_returns(rewards, values, mask, gamma).double().numpy()
    mc = mc_returns(rewards, mask, gamma).double().numpy()
    assert_valid_close(nstep_returns(rewards, values, mask, gamma, 1), td0, mask)
    assert_valid_close(nstep_returns(rewards, values, mask, gamma, longest), mc, mask)
    assert_valid_close(nstep_returns(rewards, values, mask, gamma, longest + 7), mc, mask)


@given(batches(), unit, st.integers(1, 12))
def test_telescoping_deltas_give_nstep_advantage(batch, gamma, n):
    """Σ_{l<n} γ^l δ_{t+l} = G_t^(n) − V_t, with δ from the reference and G^(n) from verl_ext."""
    rewards, values, mask = batch
    delta = ref.deltas(rewards, values, mask, gamma)
    expected = np.full(delta.shape, np.nan)
    for b in range(delta.shape[0]):
        idx = ref.valid_positions(mask[b])
        d = delta[b, idx]
        expected[b, idx] = [sum(gamma**l * d[t + l] for l in range(n) if t + l < len(d)) for t in range(len(d))]
    assert_valid_close(nstep_returns(rewards, values, mask, gamma, n) - values, expected, mask)


@given(batches(max_len=14), unit, unit)
def test_lambda_return_is_mixture_of_nstep_returns(batch, gamma, lam):
    """G^λ_t = (1−λ) Σ_{n=1}^{L−t−1} λ^{n−1} G_t^(n) + λ^{L−t−1} G_t  equals GAE + V."""
    rewards, values, mask = batch
    nstep = {n: nstep_returns(rewards, values, mask, gamma, n).double() for n in range(1, rewards.shape[1] + 1)}
    mc = mc_returns(rewards, mask, gamma).double()
    expected = torch.full(rewards.shape, float("nan"), dtype=torch.float64)
    for b in range(rewards.shape[0]):
        idx = ref.valid_positions(mask[b])
        L = len(idx)
        for t, pos in enumerate(idx):
            mix = sum((1 - lam) * lam ** (n - 1) * nstep[n][b, pos] for n in range(1, L - t))
            expected[b, pos] = mix + lam ** (L - t - 1) * mc[b, pos]
    gae_return = gae_advantages(rewards, values, mask, gamma, lam) + values
    assert_valid_close(gae_return, expected.numpy(), mask)


@given(batches(max_rows=2), unit, unit, st.integers(1, 5), st.data())
def test_inserting_masked_positions_changes_no_valid_output(batch, gamma, lam, n, data):
    rewards, values, mask = batch
    length = rewards.shape[1]
    inserts = sorted(data.draw(st.lists(st.integers(0, length), min_size=1, max_size=6)))
    keep = []  # new layout: original columns in order, with masked junk columns inserted
    for col in range(length + 1):
        keep.extend([-1] * inserts.count(col))
        if col < length:
            keep.append(col)
    index = torch.tensor([max(c, 0) for c in keep])
    inserted = torch.tensor([c < 0 for c in keep])

    def spread(x, fill):
        y = x[:, index].clone()
        y[:, inserted] = fill
        return y

    wide = (spread(rewards, 123.0), spread(values, -77.0), spread(mask, 0))
    original_cols = ~inserted
    for name in ("mc", "td0", "nstep", "gae_ext"):
        options = dict(gamma=gamma, lam=lam, n_step=n if name == "nstep" else None, whiten_advantages=False)
        narrow_result = estimate(rewards, values, mask, name, **options)
        wide_result = estimate(*wide, name, **options)
        for field in ("returns", "advantage_raw"):
            a = getattr(wide_result, field)[:, original_cols]
            b = getattr(narrow_result, field)
            valid = mask.bool()
            torch.testing.assert_close(a[valid], b[valid], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- verl's own functions


@given(batches(max_rows=6, max_len=40, junk=9.0), unit, unit)
def test_gae_ext_equals_verl_gae(batch, gamma, lam):
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    rewards, values, mask = batch
    assume(mask.sum() >= 2)  # verl's whitening needs two valid tokens
    verl_adv, verl_ret = compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    ours = estimate(rewards, values, mask, "gae_ext", gamma=gamma, lam=lam)
    valid = mask.bool()
    torch.testing.assert_close(ours.returns[valid], verl_ret[valid], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.advantages[valid], verl_adv[valid], rtol=1e-4, atol=2e-4)


@given(batches(max_rows=6, max_len=40, junk=9.0), unit, unit)
def test_the_entry_of_verls_gae_recomputes_verls_gae(batch, gamma, lam):
    """The registry's description of verl's ``gae`` (what the checker and compare recompute a gae run
    with) against verl's own function: whitened whatever algorithm.whiten_advantages says."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    rewards, values, mask = batch
    assume(mask.sum() >= 2)
    verl_adv, verl_ret = compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    entry = registry.get("gae")
    settings = entry.settings({"gamma": gamma, "lam": lam, "whiten_advantages": False})
    assert settings["whiten_advantages"] is True
    ours = registry.run(entry, rewards, values, mask, settings)
    valid = mask.bool()
    torch.testing.assert_close(ours.returns[valid], verl_ret[valid], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.advantages[valid], verl_adv[valid], rtol=1e-4, atol=2e-4)
    assert entry.is_returns_minus_values(settings)
    torch.testing.assert_close(ours.advantage_raw[valid], (verl_ret - values)[valid], rtol=1e-4, atol=1e-4)


@given(batches(max_rows=6, max_len=40, junk=3.0))
def test_masked_whiten_equals_verl(batch):
    from verl.utils.torch_functional import masked_whiten as verl_masked_whiten

    rewards, _, mask = batch
    if mask.sum() < 2:
        with pytest.raises(ValueError):
            E.masked_whiten(rewards, mask)
        return
    valid = mask.bool()
    torch.testing.assert_close(E.masked_whiten(rewards, mask)[valid], verl_masked_whiten(rewards, mask)[valid])
    assert_valid_close(E.masked_whiten(rewards, mask), ref.whiten(rewards, mask), mask)


EPS64 = float(np.finfo(np.float64).eps)


def test_whitening_is_verls_with_verls_integer_mask_to_float64_precision():
    """verl's masked_mean divides by mask.sum() + 1e-8; verl's trainer passes its response mask as an
    integer tensor, whose sum plus 1e-8 is a float32 number: n exactly, for any n ≥ 1 (1e-8 is below
    half of float32's spacing there), so μ = Σx/n (docs/definitions.md §6). verl-ext's statistics and
    whitened values against verl's own functions in float64, on a batch with holes and padding, with
    the trainer's mask dtypes. Tolerances: float64 sums of n terms (n·ε·mean|x|); σ² also carries
    verl's Bessel factor n/(n − 1), an int64 division verl rounds to float32 (2⁻²⁴ of σ²), and the
    whitened values half of that, plus the project's whitening rule with float64's ε (§8,
    Tolerances). A mean far from 0 against σ makes a 1e-8 in the count show: μ would move by
    μ·1e-8/n = 4e-9, the whitened values by that over σ (4e-7, against at most 1e-7 here). With a
    float64 mask verl's own function does divide by n + 1e-8 (what an outside cross-check saw)."""
    from verl.utils.torch_functional import masked_mean, masked_var
    from verl.utils.torch_functional import masked_whiten as verl_masked_whiten

    rng = np.random.default_rng(5)
    x = torch.tensor(100.0 + 0.01 * rng.normal(size=(6, 70)))
    mask = torch.ones(6, 70, dtype=torch.int64)
    mask[:, 50:] = 0  # padding
    mask[torch.tensor(rng.random((6, 70)) < 0.2)] = 0  # holes
    x[mask == 0] = 1e3  # what a masked position holds must not matter
    valid = mask.bool()
    n = int(valid.sum())
    x_valid = x[valid].numpy()
    assert 150 < n < 300
    for verl_mask in (mask, mask.bool()):  # attention_mask[:, -T:] (int64), and a bool mask alike
        count, mean, var = E.whitening_moments(x, mask)
        verl_mean, verl_var = masked_mean(x, verl_mask).item(), masked_var(x, verl_mask).item()
        assert count == n
        assert abs(mean - verl_mean) <= EPS64 * n * np.abs(x_valid).mean()
        centered = np.abs(x_valid - verl_mean)
        float64_sums = 4 * EPS64 * ((np.abs(x_valid) + abs(verl_mean)) * centered).sum() / (n - 1) + EPS64 * n * verl_var
        assert abs(var - verl_var) <= 2**-24 * verl_var + float64_sums
        expected = verl_masked_whiten(x, verl_mask)[valid].numpy()
        tolerance = 2**-25 * np.abs(expected) + 16 * EPS64 * (np.abs(expected) + (np.abs(x_valid) + abs(verl_mean)) / math.sqrt(verl_var))
        np.testing.assert_array_less(np.abs(E.masked_whiten(x, mask)[valid].numpy() - expected), tolerance)
        # and the definitions' direct sums (tests/support/reference.py) say the same
        np.testing.assert_array_less(np.abs(E.masked_whiten(x, mask)[valid].numpy() - ref.whiten(x, mask)[valid.numpy()]), tolerance)
    # a float64 mask, which verl's trainer does not pass: there verl's masked_mean keeps the 1e-8
    assert masked_mean(x, mask.double()).item() == pytest.approx(x_valid.sum() / (n + 1e-8), rel=4 * EPS64 * n, abs=0)
    assert abs(masked_mean(x, mask.double()).item() - x_valid.sum() / n) > 1e-9


# --------------------------------------------------------------------------- estimate(): options


@given(batches(junk=5.0), unit, unit, unit)
def test_decoupled_lambda(batch, gamma, lam_critic, lam_actor):
    rewards, values, mask = batch
    options = dict(gamma=gamma, lam_critic=lam_critic, lam_actor=lam_actor, whiten_advantages=False)
    result = estimate(rewards, values, mask, "gae_ext", **options)
    critic = ref.gae_advantages(rewards, values, mask, gamma, lam_critic) + values.double().numpy()
    assert_valid_close(result.returns, critic, mask)
    assert_valid_close(result.advantage_raw, ref.gae_advantages(rewards, values, mask, gamma, lam_actor), mask)


def test_length_adaptive_lambda_by_hand():
    """λ = 1 − 1/(α·L), α = 0.05: L = 100 → 0.8, L = 1000 → 0.98, L = 10 → −1 clamped to 0."""
    mask = torch.zeros(4, 1000, dtype=torch.int64)
    for row, length in enumerate([100, 1000, 10, 0]):
        mask[row, :length] = 1
    torch.testing.assert_close(E.length_adaptive_lam(mask, 0.05), torch.tensor([0.8, 0.98, 0.0, 0.0], dtype=torch.float64))


def test_length_adaptive_lambda_in_float64_is_the_direct_sum_at_512_tokens():
    """Float64 inputs get float64's precision: λ_b = 1 − 1/(α·L) and γ·λ_b were float32 (1e-6
    from the direct float64 sum at L = 512). Tolerance: identity 8.3's rule (§8, Tolerances) with
    float64's ε, 4ε·|expected| + ε·L·m, m the row's largest |r|, |V|, |A|."""
    rng = np.random.default_rng(3)
    length = 512
    rewards, values = torch.tensor(rng.normal(size=(2, length))), torch.tensor(rng.normal(size=(2, length)))
    mask = torch.ones(2, length, dtype=torch.int64)
    mask[1, 400:] = 0
    result = estimate(rewards, values, mask, "gae_ext", whiten_advantages=False, gamma=0.99, lam=0.9, lam_length_alpha=0.05)
    assert result.advantage_raw.dtype == torch.float64
    expected = ref.gae_advantages(rewards, values, mask, 0.99, 1 - 1 / (0.05 * np.array([512.0, 400.0])))
    eps = float(np.finfo(np.float64).eps)
    for row in range(2):
        valid = mask[row].bool().numpy()
        got, want = result.advantage_raw[row].numpy()[valid], expected[row][valid]
        m = max(np.abs(rewards[row].numpy()[valid]).max(), np.abs(values[row].numpy()[valid]).max(), np.abs(want).max())
        np.testing.assert_array_less(np.abs(got - want), 4 * eps * np.abs(want) + eps * valid.sum() * m)


def test_length_adaptive_lambda_is_used_for_advantages_only():
    rewards, values = torch.randn(3, 50), torch.randn(3, 50)
    mask = torch.ones(3, 50, dtype=torch.int64)
    mask[1, 30:] = 0
    options = dict(gamma=0.99, lam=0.9, lam_length_alpha=0.05, whiten_advantages=False)
    result = estimate(rewards, values, mask, "gae_ext", **options)
    lams = 1 - 1 / (0.05 * np.array([50.0, 30.0, 50.0]))
    assert_valid_close(result.advantage_raw, ref.gae_advantages(rewards, values, mask, 0.99, lams), mask)
    assert_valid_close(result.returns, ref.gae_advantages(rewards, values, mask, 0.99, 0.9) + values.numpy(), mask)


@pytest.mark.parametrize("name", ["mc", "td0", "nstep", "gae_ext"])
def test_returns_minus_values_is_raw_advantage_and_whitening_follows(name):
    torch.manual_seed(1)
    rewards, values = torch.randn(5, 30), torch.randn(5, 30)
    mask = (torch.rand(5, 30) > 0.2).long()
    result = estimate(rewards, values, mask, name, gamma=0.97, lam=0.9, n_step=4 if name == "nstep" else None)
    valid = mask.bool()
    torch.testing.assert_close(result.returns[valid] - values[valid], result.advantage_raw[valid])
    assert_valid_close(result.advantages, ref.whiten(result.advantage_raw, mask), mask)


def test_bfloat16_values_are_computed_in_float32():
    rewards = torch.rand(2, 300)
    values = torch.rand(2, 300).to(torch.bfloat16)
    mask = torch.ones(2, 300, dtype=torch.int64)
    returns = td0_returns(rewards, values, mask, 1.0)
    assert returns.dtype == torch.float32
    assert_valid_close(returns, ref.td0_returns(rewards, values.float(), mask, 1.0), mask, tol=1e-6)


# --------------------------------------------------------------------------- the three-token example, by hand


def test_worked_example_of_the_definitions():
    """r = [0, 0, 1], V = [0.3, 0.4, 0.6], γ = 1 (docs/definitions.md §5)."""
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.3, 0.4, 0.6]])
    mask = torch.ones(1, 3, dtype=torch.int64)

    def run(name, **kw):
        return estimate(rewards, values, mask, name, gamma=1.0, whiten_advantages=False, **kw)

    close = lambda a, b: torch.testing.assert_close(a, torch.tensor([b]), rtol=0, atol=1e-6)  # noqa: E731
    close(run("mc").advantage_raw, [0.7, 0.6, 0.4])
    close(run("mc").returns, [1.0, 1.0, 1.0])
    close(run("td0").advantage_raw, [0.1, 0.2, 0.4])
    gae = run("gae_ext", lam=0.95)
    close(gae.advantage_raw, [0.651, 0.58, 0.4])
    close(gae.returns, [0.951, 0.98, 1.0])


# --------------------------------------------------------------------------- turn-level GAE (docs/definitions.md §7)


def turn_gae(rewards, values, mask, gamma, lam, lam_critic=None, whiten_advantages=False):
    return estimate(rewards, values, mask, "turn_gae", whiten_advantages, gamma=gamma, lam=lam, lam_critic=lam_critic)


@given(batches(max_rows=5, max_len=40), unit, unit, unit)
def test_turn_gae_gives_the_direct_sums_over_turns(batch, gamma, lam, lam_critic):
    """Rows with 0 to many holes (hole rates up to 0.5: up to ~10 turns a row), γ and λ anywhere in [0, 1]."""
    rewards, values, mask = batch
    result = turn_gae(rewards, values, mask, gamma, lam, lam_critic)
    assert_valid_close(result.advantage_raw, ref.turn_gae_advantages(rewards, values, mask, gamma, lam), mask)
    critic = ref.gae_advantages(rewards, values, mask, gamma, lam_critic) + values.double().numpy()
    assert_valid_close(result.returns, critic, mask)


@given(batches(max_rows=4, max_len=30), unit, st.data())
def test_turn_gae_with_one_lambda_per_response(batch, gamma, data):
    rewards, values, mask = batch
    lams = data.draw(st.lists(unit, min_size=rewards.shape[0], max_size=rewards.shape[0]))
    _, advantage = E.turn_gae(rewards, values, mask, gamma, torch.tensor(lams), 1.0)
    assert_valid_close(advantage, ref.turn_gae_advantages(rewards, values, mask, gamma, np.array(lams)), mask)


def test_turn_gae_by_hand_with_a_hole_and_padding():
    """Turns [0, 1] and [3, 4] (a hole at 2, padding at 5, 6), r = [0, 1 | 2, 0], V = [0.3, 0.4 | 0.5, 0.6]:
    R = [1, 2], V_k = [0.3, 0.5]. γ = λ = 1: δ = [1 + 0.5 − 0.3, 2 − 0.5] = [1.2, 1.5], A = [2.7, 1.5].
    γ = 0.9, λ = 0.5: δ_0 = 1 + 0.45 − 0.3 = 1.15, A_0 = 1.15 + 0.45·1.5 = 1.825, A_1 = 1.5."""
    rewards = torch.tensor([[0.0, 1.0, 50.0, 2.0, 0.0, 7.0, 7.0]])
    values = torch.tensor([[0.3, 0.4, -9.0, 0.5, 0.6, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 0, 1, 1, 0, 0]])
    valid = mask.bool()
    torch.testing.assert_close(turn_gae(rewards, values, mask, 1.0, 1.0).advantage_raw[valid], torch.tensor([2.7, 2.7, 1.5, 1.5]))
    torch.testing.assert_close(turn_gae(rewards, values, mask, 0.9, 0.5).advantage_raw[valid], torch.tensor([1.825, 1.825, 1.5, 1.5]))


@given(batches(max_rows=4, max_len=30, junk=7.0))
def test_turn_gae_of_one_turn_is_the_return_minus_the_first_value(batch):
    """γ = λ = 1, no interior hole: every valid token gets Σ_t r_t − V_0."""
    rewards, values, mask = batch
    mask = (torch.cumsum(mask, 1) > 0).long() * (torch.arange(mask.shape[1]) < mask.shape[1] - 2).long()
    if not mask.any():
        return
    result = turn_gae(rewards, values, mask, 1.0, 1.0)
    for b in range(mask.shape[0]):
        idx = ref.valid_positions(mask[b])
        if len(idx):
            expected = float(rewards[b, idx].double().sum() - values[b, idx[0]].double())
            assert_valid_close(result.advantage_raw[b : b + 1, idx], np.full((1, len(idx)), expected), mask[b : b + 1, idx])


@given(batches(max_rows=4, max_len=20), unit, unit)
def test_turn_gae_with_one_token_per_turn_is_token_level_gae(batch, gamma, lam):
    """Holes between every two valid tokens make each token a turn: R_k = r_t, V_k = V_t, so A_k = GAE's A_t."""
    rewards, values, mask = batch
    spaced = [torch.zeros_like(x).repeat_interleave(2, dim=1) for x in (rewards, values, mask)]
    for wide, narrow in zip(spaced, (rewards, values, mask)):
        wide[:, ::2] = narrow
    result = turn_gae(*spaced, gamma, lam)
    assert_valid_close(result.advantage_raw[:, ::2], ref.gae_advantages(rewards, values, mask, gamma, lam), mask)


@given(batches(max_rows=3, max_len=20), unit, unit, st.data())
def test_widening_holes_and_padding_changes_no_turn_gae_output(batch, gamma, lam, data):
    """A hole is a hole whatever its width, and trailing padding is no hole: only splitting a turn matters."""
    rewards, values, mask = batch
    rows, length = mask.shape
    copies = [data.draw(st.integers(1, 3)) for _ in range(length)]
    # a masked column repeated (1 to 3 copies) and 0 to 3 padding columns at the end
    index = torch.tensor([c for c in range(length) for _ in range(copies[c] if not mask[:, c].any() else 1)])
    pad = data.draw(st.integers(0, 3))
    wide = [torch.cat([x[:, index], torch.full((rows, pad), fill, dtype=x.dtype)], 1) for x, fill in ((rewards, 5.0), (values, -5.0), (mask, 0))]
    kept = torch.tensor([i == 0 or index[i] != index[i - 1] for i in range(len(index))] + [False] * pad)
    narrow_result, wide_result = turn_gae(rewards, values, mask, gamma, lam), turn_gae(*wide, gamma, lam)
    valid = mask.bool()
    for field in ("returns", "advantage_raw"):
        torch.testing.assert_close(getattr(wide_result, field)[:, kept][valid], getattr(narrow_result, field)[valid], rtol=1e-5, atol=1e-5)


def test_turn_gae_entry_tells_the_checker_and_compare_what_it_is():
    entry = registry.get("turn_gae")
    settings = entry.settings({"gamma": 0.9, "lam": 0.95, "lam_critic": 0.5})
    assert entry.needs_critic and entry.options == (LAM_CRITIC,)
    assert not entry.is_returns_minus_values(settings)  # A_k per turn, returns per token
    assert entry.horizons(settings) == (pytest.approx(1 / (1 - 0.45)), math.inf)
    assert compared_settings(entry, 3, (0.5, 0.95)) == ({"lam": 1.0},)  # one column, whatever compare's λ
    with pytest.warns(UserWarning, match="adv_estimator=turn_gae ignores algorithm.lam_actor"):
        registry.check_algorithm({"adv_estimator": "turn_gae", "lam_actor": 0.5})


def test_turn_gae_returns_minus_values_is_not_its_advantage():
    """With turns the actor's and the critic's numbers differ: returns − values = GAE(λ_critic) per token."""
    rewards = torch.tensor([[0.0, 1.0, 0.0, 2.0]])
    values = torch.tensor([[0.3, 0.4, 0.0, 0.5]])
    mask = torch.tensor([[1, 1, 0, 1]])
    result = turn_gae(rewards, values, mask, 1.0, 1.0, whiten_advantages=True)
    valid = mask.bool()
    torch.testing.assert_close(result.returns[valid] - values[valid], torch.tensor([2.7, 2.6, 1.5]))
    torch.testing.assert_close(result.advantage_raw[valid], torch.tensor([2.7, 2.7, 1.5]))
    assert_valid_close(result.advantages, ref.whiten(result.advantage_raw, mask), mask)


# --------------------------------------------------------------------------- bad input


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="values has shape"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match=r"must be \(B, T\)"):
        mc_returns(torch.zeros(3), torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="per-response lam"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), 1.0, torch.ones(3))


@pytest.mark.parametrize("n", [0, -1, 2.5, True])
def test_nstep_rejects_bad_n(n):
    with pytest.raises(ValueError, match="n must be an integer"):
        nstep_returns(torch.zeros(1, 3), torch.zeros(1, 3), torch.ones(1, 3), 1.0, n)


# --------------------------------------------------------------------------- more than one row group


@pytest.mark.parametrize("name", ["mc", "td0", "nstep", "gae_ext", "gae_ext decoupled", "gae_ext adaptive", "turn_gae"])
def test_many_row_groups_give_the_direct_sums(monkeypatch, name):
    """Groups of 40 tokens over 9 rows of 23: every estimator and the whitening span several groups."""
    monkeypatch.setattr(kernels, "ROW_GROUP_TOKENS", 40)
    assert len(kernels.row_groups(9, 23)) == 9
    g = torch.Generator().manual_seed(5)
    mask = (torch.rand(9, 23, generator=g) > 0.25).long()
    mask[3] = 0  # a row without any valid token
    rewards, values = torch.randn(9, 23, generator=g), torch.randn(9, 23, generator=g)
    options = {"mc": {}, "td0": {}, "nstep": {"n_step": 3}, "gae_ext": {"lam": 0.8}}.get(name)
    if name == "gae_ext decoupled":
        options = {"lam_critic": 1.0, "lam_actor": 0.7}
    elif name == "gae_ext adaptive":
        options = {"lam": 0.9, "lam_length_alpha": 0.2}
    elif name == "turn_gae":
        options = {"lam": 0.7, "lam_critic": 0.9}
    result = estimate(rewards, values, mask, name.split()[0], gamma=0.95, **options)
    lengths = mask.sum(1).double().numpy()
    expected_returns = {
        "mc": lambda: ref.mc_returns(rewards, mask, 0.95),
        "td0": lambda: ref.td0_returns(rewards, values, mask, 0.95),
        "nstep": lambda: ref.nstep_returns(rewards, values, mask, 0.95, 3),
        "gae_ext": lambda: ref.gae_advantages(rewards, values, mask, 0.95, 0.8) + values.numpy(),
        "gae_ext decoupled": lambda: ref.gae_advantages(rewards, values, mask, 0.95, 1.0) + values.numpy(),
        "gae_ext adaptive": lambda: ref.gae_advantages(rewards, values, mask, 0.95, 0.9) + values.numpy(),
        "turn_gae": lambda: ref.gae_advantages(rewards, values, mask, 0.95, 0.9) + values.numpy(),
    }[name]()
    expected_raw = {
        "gae_ext decoupled": lambda: ref.gae_advantages(rewards, values, mask, 0.95, 0.7),
        "gae_ext adaptive": lambda: ref.gae_advantages(
            rewards, values, mask, 0.95, np.clip(1 - 1 / (0.2 * np.maximum(lengths, 1e-9)), 0, 1)
        ),
        "turn_gae": lambda: ref.turn_gae_advantages(rewards, values, mask, 0.95, 0.7),
    }.get(name, lambda: expected_returns - values.numpy())()
    assert_valid_close(result.returns, expected_returns, mask, tol=1e-5)
    assert_valid_close(result.advantage_raw, expected_raw, mask, tol=1e-5)
    assert_valid_close(result.advantages, ref.whiten(expected_raw, mask), mask, tol=1e-5)

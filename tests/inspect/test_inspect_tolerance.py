"""The measurements behind the tolerances (docs/definitions.md#tolerances): float32 producers stay
well inside them, and a change of 1e-2 relative stays well outside."""

import numpy as np
import pytest
import torch

from verl_ext import estimators
from verl_ext.check.token_checks import ACCUMULATED as accumulated_tolerance
from verl_ext.check.token_checks import EPS32
from verl_ext.check.token_checks import WHITENING_FACTOR as WHITENING

EPS = EPS32


@pytest.mark.parametrize("length", [1024, 16384])
def test_verl_float32_gae_drift_is_a_tenth_of_the_bound(length):
    """Constant per-token rewards (the worst case measured): verl's Python loop in float32 drifts
    linearly, up to 0.1·ε·L·m; the tolerance allows ε·L·m."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    rewards = torch.full((2, length), -0.0013)
    rewards[:, -1] = 1.0
    values = torch.linspace(0, 1, length).repeat(2, 1).to(torch.bfloat16).float()
    mask = torch.ones(2, length)
    _, returns = compute_gae_advantage_return(rewards, values, mask, 1.0, 1.0)
    exact = estimators.gae(rewards.double(), values.double(), mask.double(), 1.0, 1.0)[0]
    error = (returns.double() - exact).abs().max().item()
    magnitude = max(rewards.abs().max().item(), values.abs().max().item(), exact.abs().max().item())
    assert error <= 0.11 * EPS * length * magnitude
    tol = accumulated_tolerance(exact.numpy(), np.full(exact.shape, float(length)), np.full(exact.shape, magnitude))
    assert (tol >= 5 * error).all()
    assert (tol < 1e-2 * np.abs(exact.numpy()).max()).all()  # a 1e-2 relative change at the largest return shows


@pytest.mark.parametrize("mean, std", [(5.0, 0.01), (0.1, 1.0)])
def test_float32_whitening_error_is_far_inside_the_bound(mean, std):
    """verl's and verl-ext's masked_whiten on 1 M float32 tokens: at most 1.3e-7 of the scale."""
    from verl.utils.torch_functional import masked_whiten as verl_whiten

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 4096, generator=g) * std + mean
    mask = (torch.rand(256, 4096, generator=g) > 0.2).float()
    xd = x.double()
    n = mask.sum().double()
    mu = (xd * mask).sum() / n  # docs/definitions.md §6
    var = (((xd - mu) ** 2) * mask).sum() / (n - 1)
    sigma = torch.sqrt(var + 1e-8)
    exact = (xd - mu) / sigma
    scale = exact.abs() + (xd.abs() + mu.abs()) / sigma
    for whiten in (verl_whiten, estimators.masked_whiten):
        relative = ((whiten(x, mask).double() - exact).abs() / scale)[mask.bool()].max().item()
        assert relative <= 1.3e-7
        assert WHITENING >= 10 * relative

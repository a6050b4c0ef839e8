"""The tolerances of docs/definitions.md#tolerances, written again from its text, for the tests that
hold what a float32 producer computed in a run (verl's trainer, verl-ext's estimators in it) to a
float64 reference: ATOL + a multiple of ε times the magnitudes the producer combined. They bound the
producer's own rounding, whatever order a CPU's kernels sum in (another machine's vector width, or
``ATEN_CPU_CAPABILITY``), so such a test holds on any CPU, and still sees a 1e-2 change of one
number. Not imported from the checker (verl_ext.check), whose tolerances are among what the tests
test. And one the checker has no use for: an fp32 engine's log-probs against a float64 forward pass
(:func:`forward_pass`)."""

from __future__ import annotations

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)
EPS64 = float(np.finfo(np.float64).eps)
#: Below this nothing is claimed in float32 (docs/definitions.md#tolerances).
ATOL = 1e-6


def per_row(mask, *arrays) -> tuple[np.ndarray, np.ndarray]:
    """(L, m) of each row of (B, T) arrays, as (B, 1): its valid tokens' count and the largest |x| of
    ``arrays`` at them (0 for an empty row)."""
    valid = np.asarray(mask) != 0
    lengths = valid.sum(axis=1, keepdims=True).astype(np.float64)
    magnitude = np.zeros((valid.shape[0], 1))
    for array in arrays:
        values = np.where(valid, np.abs(np.asarray(array, np.float64)), 0.0)
        magnitude = np.maximum(magnitude, values.max(axis=1, keepdims=True, initial=0.0))
    return lengths, magnitude


def accumulated(expected, terms, magnitude, eps: float = EPS32, atol: float = ATOL) -> np.ndarray:
    """Recomputed returns and advantages, sums of ``terms`` terms of at most ``magnitude`` each:
    ATOL + 4ε·|expected| + ε·n·m."""
    return atol + 4 * eps * np.abs(np.asarray(expected, np.float64)) + eps * np.asarray(terms) * np.asarray(magnitude)


def whitened(expected, operands_over_sigma, eps: float = EPS32, atol: float = ATOL) -> np.ndarray:
    """(x − μ)/σ whitened by the producer's float32 statistics: ATOL + 16ε·(|A| + (|x| + |μ| + …)/σ)."""
    return atol + 16 * eps * (np.abs(np.asarray(expected, np.float64)) + np.asarray(operands_over_sigma))


def whitening_operands(x, mask, *inputs) -> np.ndarray:
    """(|x| + |μ| + Σ|input|)/σ, μ and σ (n − 1, with verl's + 1e-8) over ``mask``'s entries of x: what
    the whitening bound scales with; ``inputs`` are what x was formed from (returns, values)."""
    x = np.asarray(x, np.float64)
    selected = x[np.asarray(mask) != 0]
    mean, sigma = selected.mean(), np.sqrt(selected.var(ddof=1) + 1e-8)
    operands = np.abs(x) + abs(mean)
    for array in inputs:
        operands = operands + np.abs(np.nan_to_num(np.asarray(array, np.float64)))
    return operands / sigma


def forward_pass(logits, positions, config, lam: float = 8.0) -> np.ndarray:
    """The float32 rounding of one forward pass of a decoder (another engine's log-probs against the exact
    ones, float64): 2·λ·√N·u·max_v|z_tv| per token t, u = ε/2 (round to nearest), N the terms summed in
    series on the way to the logits z_t (per layer: the q/k/v projection's hidden size, the head's
    dimension in q·k, the t + 1 positions attention averages, o_proj, gate/up, down's intermediate size;
    then lm_head). Higham & Mary's probabilistic bound (SIAM J. Sci. Comput. 2019): a sum of N rounded
    terms is within λ√N·u of its magnitude unless with probability below 2N·exp(−λ²/2) (λ = 8, N ≈ 1,500: 4e-11),
    not the worst case N·u, which would not tell a bf16 engine from fp32; the log-softmax passes the
    logits' error on at most twice. ``logits`` (T, V), ``positions`` (T,): each token's index in the
    sequence it was scored in."""
    hidden, head = config.hidden_size, config.hidden_size // config.num_attention_heads
    per_layer = 3 * hidden + head + config.intermediate_size
    terms = config.num_hidden_layers * (per_layer + np.asarray(positions, np.float64) + 1) + hidden
    scale = np.abs(np.asarray(logits, np.float64)).max(axis=-1)
    return 2 * lam * np.sqrt(terms) * (EPS32 / 2) * scale


def assert_within(actual, expected, tolerance, what: str = "") -> None:
    """|actual − expected| < tolerance, element by element, with the worst element in the message."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    error = np.abs(actual - expected)
    tolerance = np.broadcast_to(np.asarray(tolerance, np.float64), error.shape)
    if error.size and not (error < tolerance).all():
        worst = int(np.argmax(error / tolerance))
        raise AssertionError(
            f"{what}: {int((error >= tolerance).sum())} of {error.size} outside the tolerance; worst at {worst}: "
            f"{actual.flat[worst]!r} against {expected.flat[worst]!r}, error {error.flat[worst]:.3g} > {tolerance.flat[worst]:.3g}"
        )

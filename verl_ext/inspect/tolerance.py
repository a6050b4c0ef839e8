"""How far a traced number may be from its recomputation and still count as equal.

Traces store float32; the checker recomputes in float64 from those float32 inputs, so the
difference is the producer's own float32 rounding. Every tolerance here is

    ATOL + (a multiple of float32's ε) × (the magnitude of the numbers the producer combined),

so it scales with the data, and it is far below a real discrepancy: a single token changed by
1e-2 relative is caught (tests plant exactly that). The multiples, and why:

* elementwise identities (r = s − β·kl, raw = R − V): one or two float32 roundings of the operands,
  so 4ε·(|a| + |b|).
* recomputed returns and GAE advantages: the producer sums up to n terms in float32 (verl's
  Python loop over T, verl-ext's blocked scan). Rounding errors can pile up linearly: measured at
  up to 0.1·ε·n·m with n the terms summed and m the largest magnitude in the row (constant
  rewards, rows of 1k to 16k tokens), so the bound is ε·n·m (10x that worst case) plus 4ε·|expected|.
  n is the row's length L, or the estimator's horizon when shorter: 1 for td0, n for nstep,
  1/(1 − γλ) for GAE and 1/(1 − γ) for mc.
* whitening: the producer's batch mean and variance are float32 too; their error scales the
  whole token by 1/σ. Measured at up to 1.3e-7 × (|A| + (|x| + |μ|)/σ) for verl's and verl-ext's
  masked_whiten on 1M tokens; the bound is 16ε (≈ 1.9e-6) × (|A| + (|x| + |μ| + |R| + |V|)/σ),
  where |R| + |V| covers traces whose raw advantage was rebuilt as returns − values (verl's gae).
"""

from __future__ import annotations

import numpy as np

EPS32 = float(np.finfo(np.float32).eps)  # 2^-23
#: Below this nothing is claimed: float32 data of order one round at ~6e-8.
ATOL = 1e-6
ELEMENTWISE = 4 * EPS32
ACCUMULATED = EPS32
WHITENING = 16 * EPS32


def elementwise(scale: np.ndarray) -> np.ndarray:
    """Tolerance of an identity between float32 operands whose magnitudes add up to ``scale``."""
    return ATOL + ELEMENTWISE * scale


def accumulated(expected: np.ndarray, terms: np.ndarray, magnitude: np.ndarray) -> np.ndarray:
    """Tolerance of a float32 sum of ``terms`` terms of at most ``magnitude`` each (per token)."""
    return ATOL + ELEMENTWISE * np.abs(expected) + ACCUMULATED * terms * magnitude


def whitening(expected: np.ndarray, scale_over_sigma: np.ndarray) -> np.ndarray:
    """Tolerance of (x − μ)/σ given |A| and the operands' magnitude divided by σ."""
    return ATOL + WHITENING * (np.abs(expected) + scale_over_sigma)


def summed_terms(lengths: np.ndarray, decay: float | np.ndarray) -> np.ndarray:
    """Terms a discounted sum with this decay effectively adds up over rows of these lengths."""
    decay = np.asarray(decay, dtype=np.float64)
    with np.errstate(divide="ignore"):
        horizon = np.where(decay < 1.0, 1.0 / (1.0 - np.minimum(decay, 1.0)), np.inf)
    return np.minimum(lengths, horizon)


ELEMENTWISE_TEXT = f"{ATOL:g} + 4ε·Σ|operand|"
ACCUMULATED_TEXT = f"{ATOL:g} + 4ε·|expected| + ε·n·m"
WHITENING_TEXT = f"{ATOL:g} + 16ε·(|A| + (|x|+|μ|+|R|+|V|)/σ)"
STATISTICS_TEXT = f"{ATOL:g} + 16ε·(|μ|+σ)"

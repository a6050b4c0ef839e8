"""Returns and raw advantages recomputed from a step's rewards and values, with their tolerances.

The estimator is :func:`verl_ext.estimators.estimate` itself, run in float64 on the trace's float32
inputs (so the only error left is the producer's float32 rounding), one dense row group of the
step at a time (:meth:`StepLayout.row_groups`), whose masked positions it skips as it does in training.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from verl_ext import estimators
from verl_ext.inspect import tolerance
from verl_ext.inspect.recorded import RecordedAlgorithm
from verl_ext.inspect.stepdata import StepData
from verl_ext.torch_threads import one_torch_thread


@dataclass(frozen=True)
class Recomputed:
    """Returns and raw advantages recomputed at the step's valid tokens, with their tolerances."""

    returns: np.ndarray
    raw: np.ndarray
    returns_tolerance: np.ndarray
    raw_tolerance: np.ndarray


def recompute(algorithm: RecordedAlgorithm, data: StepData) -> Recomputed:
    """Returns and raw advantages at the step's valid tokens, as the run's estimator makes them."""
    with one_torch_thread():  # row groups are cache-sized: threads only contend
        return _recompute_groups(algorithm, data)


def _recompute_groups(algorithm: RecordedAlgorithm, data: StepData) -> Recomputed:
    options = dataclasses.replace(algorithm.options, whiten_advantages=False)
    layout = data.layout
    reward, value = data.columns["reward"], data.columns["value"]
    returns, raw = np.empty(data.tokens), np.empty(data.tokens)
    for group in layout.row_groups():
        result = estimators.estimate(
            torch.from_numpy(group.dense(reward)),
            torch.from_numpy(group.dense(value)),
            torch.from_numpy(group.mask()),
            options,
        )
        returns[group.tokens] = group.gather(result.returns.numpy())
        raw[group.tokens] = group.gather(result.advantage_raw.numpy())
    # tolerances: the largest magnitude in each row (inputs and outputs) and the terms summed per row
    magnitude = np.maximum(np.maximum(np.abs(reward), np.abs(value)), np.maximum(np.abs(returns), np.abs(raw)))
    nonempty = layout.valid_counts > 0
    row_magnitude = np.zeros(layout.samples)
    row_magnitude[nonempty] = np.maximum.reduceat(magnitude, layout.valid_starts[nonempty]) if len(magnitude) else 0.0
    returns_terms, raw_terms = _summed_terms(options, layout.valid_counts)
    token_sample = layout.valid_sample_index()
    row_magnitude = row_magnitude[token_sample]
    return Recomputed(
        returns,
        raw,
        tolerance.accumulated(returns, returns_terms[token_sample], row_magnitude),
        tolerance.accumulated(raw, raw_terms[token_sample], row_magnitude),
    )


def _summed_terms(options, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Terms the producer summed per row, for the returns and for the raw advantage."""
    lengths = lengths.astype(np.float64)
    if options.name == "td0":
        return np.ones_like(lengths), np.ones_like(lengths)
    if options.name == "nstep":
        terms = np.minimum(lengths, options.n_step)
        return terms, terms
    if options.name == "mc":
        terms = tolerance.summed_terms(lengths, options.gamma)
        return terms, terms
    returns_terms = tolerance.summed_terms(lengths, options.gamma * options.critic_lam)
    # a length-adaptive λ_actor has a horizon below L; L itself is the safe bound
    actor_decay = 1.0 if options.lam_length_alpha is not None else options.gamma * options.actor_lam
    return returns_terms, tolerance.summed_terms(lengths, actor_decay)

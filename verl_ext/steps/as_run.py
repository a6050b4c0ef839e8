"""A traced step's estimate made again as the run made it: returns, raw advantages, the advantages
before and after whitening, the whitening's statistics and what could not be done as the run did.
The checker, ``compare``, the view, ``replay`` and the credit analysis all ask :func:`as_run`.

The treatments of responses cut at the length limit (``algorithm.truncation``,
docs/definitions.md#truncated-responses), settled here once:

* ``terminal``: every response as if it ended (V(s_L) = 0);
* ``bootstrap``: the returns and raw advantages of rewards whose last valid token is paid γ·V(s_L)
  more on a cut response (its recorded ``bootstrap_value``);
* ``mask``: the returns and raw advantages are the terminal ones (the estimator's output, which the
  trace records as ``advantage_raw``); the advantage before whitening is 0 on every token of a cut
  response; the whitening statistics are over the other responses' tokens, and a cut response's
  whitened advantage is 0 (docs/definitions.md#6-whitening-and-why-it-comes-after-the-returns).

Where the step cannot say what the run's treatment needs (no ``truncated`` flags; a cut response
without V(s_L)), the estimate is the terminal one and a note says so; a treatment asked for
explicitly (``mode``) that the step cannot give is a ValueError instead.

The estimator runs through :func:`verl_ext.registry.run` (the code path of training) in float64,
one dense row group of the step at a time; the whitening is :func:`verl_ext.estimators.masked_whiten`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, NamedTuple

import numpy as np

from verl_ext.steps.cuts import StepCuts
from verl_ext.steps.layout import StepData
from verl_ext.steps.recorded import RecordedAlgorithm


class Whitening(NamedTuple):
    """μ and σ² (unbiased) of the advantages before whitening, over ``tokens`` ((N,) bool at the
    step's valid tokens), as ``masked_whiten`` computes them."""

    mean: float
    var: float
    tokens: np.ndarray

    def statistics(self) -> dict[str, float]:
        """{"mean", "var"}, as the run record keeps them."""
        return {"mean": self.mean, "var": self.var}


@dataclass(frozen=True)
class AsRun:
    """A step's estimate as the run made it, at its valid tokens (float64). The whitening is done
    when first asked for (the checker needs only the returns and raw advantages)."""

    #: the treatment of cut responses applied (the run's, or terminal where the step cannot say: see notes)
    mode: str
    #: the critic's target
    returns: np.ndarray
    #: the estimator's advantage
    advantage_raw: np.ndarray
    #: the advantage before whitening: the raw one, 0 on a cut response under ``mask``
    before_whitening: np.ndarray
    #: the tokens the whitening is over ((N,) bool: all, less the cut responses under ``mask``);
    #: None when the run does not whiten
    whitened_tokens: np.ndarray | None
    notes: tuple[str, ...]

    @property
    def advantages(self) -> np.ndarray:
        """What the actor trains on: ``before_whitening`` whitened when the run whitens (0 on a cut
        response under ``mask``; all 0 under ``mask`` with fewer than two tokens to whiten over; NaN
        with fewer than two valid tokens, where whitening is undefined)."""
        return self._whitened[0]

    @property
    def whitening(self) -> Whitening | None:
        """The statistics of the whitening; None when the run does not whiten, or where it cannot."""
        return self._whitened[1]

    @cached_property
    def _whitened(self) -> tuple[np.ndarray, Whitening | None]:
        kept = self.whitened_tokens
        if kept is None:
            return self.before_whitening, None
        if kept.sum() < 2:
            fill = 0.0 if self.mode == "mask" else np.nan  # Truncation.whiten: no statistics, no advantage
            return np.full(len(kept), fill), None
        import torch

        from verl_ext import estimators

        values, mask = torch.from_numpy(self.before_whitening)[None], torch.from_numpy(kept.astype(np.float64))[None]
        _, mean, var = estimators.whitening_moments(values, mask)
        white = estimators.masked_whiten(values, mask)[0].numpy()
        return np.where(kept, white, 0.0), Whitening(mean, var, kept)


def as_run(
    data: StepData,
    algorithm: RecordedAlgorithm,
    cuts: StepCuts | None = None,
    estimator: Any = None,
    settings: Mapping[str, Any] | None = None,
    mode: str | None = None,
) -> AsRun:
    """The step's estimate as the run made it (module docstring), from ``data``'s ``reward`` and
    ``value``: the run's estimator, or ``estimator`` at ``settings`` in its place (another estimator
    as the run would have trained on it), under the run's treatment of cut responses, or ``mode``.
    ``cuts``: the step's cut responses (:meth:`StepCuts.read`; None: none known)."""
    if estimator is None:
        if not algorithm.recomputable:
            raise ValueError(f"the run's estimator cannot be recomputed: {algorithm.why_not}")
        estimator, settings = algorithm.estimator, algorithm.settings
    asked = mode is not None
    mode = algorithm.truncation if mode is None else mode
    notes: list[str] = []
    problem = _cannot_treat(cuts, mode)
    if problem and asked:
        raise ValueError(f"truncation={mode} cannot be recomputed: {problem}")
    if problem:
        notes.append(f"re-estimated as terminal: {problem}")
        mode = "terminal"
    returns, raw = data.estimate(estimator, settings, None if mode == "terminal" else lambda samples: cuts.truncation(mode, samples))
    cut = cuts.at_tokens(data.layout) if mode == "mask" else np.zeros(len(raw), bool)
    kept = ~cut if settings["whiten_advantages"] else None
    if kept is not None and kept.sum() < 2:
        notes.append(
            "fewer than two tokens outside the cut responses: every advantage is 0 (truncation=mask)"
            if mode == "mask" else "fewer than two valid tokens: whitening is undefined"
        )  # fmt: skip
    return AsRun(mode, returns, raw, np.where(cut, 0.0, raw), kept, tuple(notes))


def _cannot_treat(cuts: StepCuts | None, mode: str) -> str | None:
    """Why ``cuts`` cannot give ``mode`` (one line), None when it can."""
    if mode == "terminal":
        return None
    if cuts is None:
        return "the step's cut responses are not known here"
    return cuts.why_not(mode)

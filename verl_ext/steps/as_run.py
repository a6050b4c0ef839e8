"""A traced step's estimate made again as the run made it: returns, raw advantages, the advantages
before and after whitening, the whitening's statistics and what could not be done as the run did.
The checker, ``compare``, the view, ``replay`` and the credit analysis all ask :func:`as_run`; and each
registered estimator in the run's place (:func:`step_estimates`: ``compare``'s columns), and the
Monte-Carlo return, the critic's yardstick (:func:`monte_carlo_returns`).

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


# --------------------------------------------------------------------------- every estimator in the run's place

#: The λ of the GAE columns by default (0 is td0, 1 is mc: the two ends of the family).
DEFAULT_LAMBDAS = (0.5, 0.9, 0.95)
#: n of the n-step column by default. Both defaults are also `verl-ext compare`'s.
DEFAULT_N = 3


def estimator_columns(algorithm: RecordedAlgorithm, n: int, lambdas: tuple[float, ...]) -> tuple[dict, list[str]]:
    """label -> (registered estimator, settings), every estimator of the registry at the settings its
    entry asks for (:func:`compared_settings`, at the run's γ), then the run's own estimator at the
    run's settings (in place of the column of the same label); and notes on what could not be compared."""
    from verl_ext import registry

    columns, notes = {}, []
    for estimator in registry.all_estimators():
        for asked in compared_settings(estimator, n, lambdas):
            try:
                settings = estimator.settings({**asked, "gamma": algorithm.gamma})
            except ValueError as exc:  # an option without a default, which compare cannot choose
                notes.append(f"{estimator.name} is not compared: {exc}")
                continue
            columns[column_label(estimator, settings)] = (estimator, settings)
    if algorithm.recomputable:
        columns[column_label(algorithm.estimator, algorithm.settings)] = (algorithm.estimator, algorithm.settings)
    else:
        notes.append(f"the run's own estimator is not compared: {algorithm.why_not}")
    return columns, notes


def compared_settings(estimator, n: int, lambdas: tuple[float, ...]) -> tuple[dict, ...]:
    """The ``algorithm`` settings of an estimator's columns (the run's γ is added), from compare's n
    (of the n-step estimator) and λs: its entry's ``compared_at(n, lambdas)``; by default one column
    at its options' defaults."""
    return estimator.compared_at(n, lambdas) if estimator.compared_at else ({},)


def column_label(estimator, settings) -> str:
    """The name of an estimator's column at ``settings``: its entry's ``label(settings)`` (two settings
    that give different numbers get different labels); by default its name."""
    return estimator.label(settings) if estimator.label else estimator.name


def step_estimates(
    data: StepData,
    algorithm: RecordedAlgorithm,
    n: int = DEFAULT_N,
    lambdas: tuple[float, ...] = DEFAULT_LAMBDAS,
    labels: tuple[str, ...] | None = None,
    cuts: StepCuts | None = None,
    mode: str | None = None,
) -> tuple[dict[str, np.ndarray], list[str]]:
    """label -> advantage before whitening (float64) at the valid tokens of ``data`` (which holds
    ``reward`` and ``value``), one entry per estimator of :func:`estimator_columns`, or per one of
    ``labels`` in that order (ValueError for a label that is not a column); and notes on what was left
    out. Each estimator as the run would have trained on it (:func:`verl_ext.steps.as_run.as_run`): cut
    responses (``cuts``, of ``data``'s layout) treated as the run did, or as ``mode`` says."""
    columns, notes = estimator_columns(algorithm, n, tuple(lambdas))
    if labels is not None:
        unknown = [label for label in labels if label not in columns]
        if unknown:
            raise ValueError(f"no estimator column {', '.join(unknown)} at λ = {lambdas}; columns: {', '.join(columns)}")
        columns = {label: columns[label] for label in labels}
    estimates = {label: as_run(data, algorithm, cuts, estimator, settings, mode) for label, (estimator, settings) in columns.items()}
    notes += dict.fromkeys(note for estimate in estimates.values() for note in estimate.notes)  # the same for every column
    return {label: estimate.before_whitening for label, estimate in estimates.items()}, notes


def monte_carlo_returns(data: StepData, gamma: float) -> np.ndarray:
    """(N,) float64 G_t = Σ_{k≥t} γ^{k−t} r_k at the step's N valid tokens, from its ``reward``
    column, by the registry's ``mc`` estimator (the code path of training). Needs ``value`` too
    (``mc`` needs the critic), although G does not depend on it."""
    from verl_ext import registry

    mc = registry.get("mc")
    return data.estimate(mc, mc.settings({"gamma": gamma}))[0]

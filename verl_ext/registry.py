"""One registry of advantage estimators: each name is dispatched here, and only here.

An estimator is a function ``fn(rewards, values, response_mask, *, gamma, lam, config) ->
(returns, advantage_raw)``, all tensors (B, T) (``values`` is None for an estimator that needs no
critic), registered once with what the rest of verl-ext needs to know about it::

    import verl_ext

    @verl_ext.register_estimator("td_half")
    def td_half(rewards, values, response_mask, *, gamma, lam, config):
        from verl_ext import estimators
        return estimators.gae(rewards, values, response_mask, gamma, 0.5)

Everything else reads the registry: option validation on the driver, the seam in verl's
``compute_advantage`` (both trainers), the critic rule, the trace's run record, the checker's
recomputation, ``compare``'s columns, the study's runs, the CLI's descriptions. ``config`` is a plain
dict: the run's ``algorithm`` settings, ``gamma`` and ``lam`` as verl passed them, and the
estimator's declared options parsed and defaulted.

The built-in estimators are registered the same way, from :mod:`verl_ext.builtin_estimators`, when
this module is imported. There too, the verl estimators verl-ext understands (``gae``, ``grpo``) are
described by entries of the same kind (:func:`describe_verl_estimator`): verl computes them and owns
their names, so they are never put into verl's registry; the entry says what verl-ext knows of them
(how to recompute them from a trace, whether they need the critic, whether verl whitens them). Ask
the entry (:func:`lookup`), never the name.
"""

from __future__ import annotations

import dis
import inspect
import math
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from verl_ext import builtin_estimators, estimators
from verl_ext.builtin_estimators import docstring_formula
from verl_ext.options import (
    ALGORITHM_OPTIONS,
    TRUNCATION,
    WHITEN_ADVANTAGES,
    Option,
    algorithm_settings,
    unit_interval,
)
from verl_ext.truncation import Truncation

EstimatorFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Settings = Mapping[str, Any]


@dataclass(frozen=True)
class Estimator:
    """A registered estimator and what the rest of verl-ext needs to know about it.

    * ``options``: keys under ``algorithm`` it reads (``whiten_advantages`` is implied);
    * ``formula``: what it computes, in one line (shown by the CLI and the checker);
    * ``horizon(settings) -> (returns, advantage)``: how many rewards each output sums at most
      (inf: the whole response), which sizes the checker's float32 tolerance;
    * ``returns_minus_values(settings)``: True when advantage_raw = returns − values exactly, which
      the checker then verifies elementwise (otherwise it recomputes the advantage with ``fn``);
    * ``uses_lam``: whether ``algorithm.lam`` matters, for descriptions (by default :func:`reads_lam`);
    * ``compared_at`` and ``label``: its columns in ``verl-ext compare``
      (:func:`verl_ext.steps.as_run.estimator_columns` says how they are read);
    * ``computed_by_verl``: one of verl's own estimators, which verl computes and verl-ext only
      describes (``fn`` None: verl-ext cannot recompute it from a trace); ``verl_whitens`` says
      whether verl whitens its advantages (None: verl-ext cannot tell), where verl-ext's own
      estimators follow ``algorithm.whiten_advantages``.
    """

    name: str
    fn: EstimatorFn | None
    needs_critic: bool = True
    options: tuple[Option, ...] = ()
    formula: str = ""
    horizon: Callable[[Settings], tuple[float, float]] | None = None
    returns_minus_values: Callable[[Settings], bool] | None = None
    uses_lam: bool = True
    compared_at: Callable[[int, tuple[float, ...]], tuple[dict[str, Any], ...]] | None = None
    label: Callable[[Settings], str] | None = None
    computed_by_verl: bool = False
    verl_whitens: bool | None = None

    @property
    def module(self) -> str:
        """Where ``fn`` is defined: the module to import for recomputing a trace of this estimator."""
        return self.fn.__module__

    @property
    def recomputable(self) -> bool:
        """verl-ext can recompute its returns and raw advantages from a trace's rewards and values."""
        return self.fn is not None

    @property
    def all_options(self) -> tuple[Option, ...]:
        """The ``algorithm`` keys it reads; verl's own estimators ignore ``whiten_advantages``; every
        estimator verl-ext knows follows ``truncation``."""
        return (*self.options, TRUNCATION) if self.computed_by_verl else (*self.options, WHITEN_ADVANTAGES, TRUNCATION)

    def settings(self, algorithm: Any, gamma: float | None = None, lam: float | None = None) -> dict[str, Any]:
        """The ``config`` ``fn`` receives: the algorithm's settings with γ, λ and this estimator's
        options parsed and defaulted. ValueError naming the key for a bad or missing value."""
        settings = algorithm_settings(algorithm)
        settings["gamma"] = unit_interval("algorithm.gamma", settings.get("gamma", 1.0) if gamma is None else gamma)
        settings["lam"] = unit_interval("algorithm.lam", settings.get("lam", 1.0) if lam is None else lam)
        for option in self.all_options:
            settings[option.key] = option.read(settings)
            if option.required and settings[option.key] is None:
                raise ValueError(f"algorithm.adv_estimator={self.name} needs algorithm.{option.key} ({option.help})")
        if self.computed_by_verl:
            settings["whiten_advantages"] = self.verl_whitens
        return settings

    def describe(self, settings: Settings) -> str:
        """The estimator with the settings that determine its numbers, e.g. ``nstep(γ=0.99, n_step=3)``."""
        shown = {"γ": settings.get("gamma")}
        if self.uses_lam:
            shown["λ"] = settings.get("lam")
        shown |= {o.key: settings.get(o.key) for o in self.options if settings.get(o.key) is not None}
        return f"{self.name}({', '.join(f'{k}={_short(v)}' for k, v in shown.items())})"

    def horizons(self, settings: Settings) -> tuple[float, float]:
        return self.horizon(settings) if self.horizon else (math.inf, math.inf)

    def is_returns_minus_values(self, settings: Settings) -> bool:
        return bool(self.returns_minus_values and self.returns_minus_values(settings))


class MissingCriticValues(ValueError):
    """An estimator that needs the critic's values (``needs_critic``) was run without them."""


@dataclass(frozen=True)
class Estimate:
    """What an estimator produces, all (B, T): the critic's target, the raw advantage, and the
    advantage the actor trains on (whitened when ``whiten_advantages`` is on); and ``whitening``, the
    statistics it was whitened with, {"mean": μ, "var": σ²} (None when it was not)."""

    returns: torch.Tensor
    advantage_raw: torch.Tensor
    advantages: torch.Tensor
    whitening: dict[str, float] | None = None


_ESTIMATORS: dict[str, Estimator] = {}
#: verl's own estimators that verl-ext describes; apart, so that registering one of their names is
#: refused by verl (which owns them), as for any other name verl holds.
_VERL_ESTIMATORS: dict[str, Estimator] = {}
_LISTENERS: list[Callable[[Estimator], None]] = []


def register_estimator(
    name: str,
    *,
    needs_critic: bool = True,
    options: tuple[Option, ...] = (),
    formula: str | None = None,
    horizon: Callable[[Settings], tuple[float, float]] | None = None,
    returns_minus_values: Callable[[Settings], bool] | None = None,
    uses_lam: bool | None = None,
    compared_at: Callable[[int, tuple[float, ...]], tuple[dict[str, Any], ...]] | None = None,
    label: Callable[[Settings], str] | None = None,
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Register ``fn(rewards, values, response_mask, *, gamma, lam, config) -> (returns, advantage_raw)``
    under ``name`` for ``algorithm.adv_estimator`` (see the module docstring and :class:`Estimator`
    for the keywords). Returns ``fn`` unchanged.

    Registering the same function again is a no-op; another function under a taken name is a
    ValueError. Works before or after verl's ``core_algos`` is imported.
    """
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"an estimator name must be a non-empty string without surrounding spaces, got {name!r}")

    def decorator(fn: EstimatorFn) -> EstimatorFn:
        if not callable(fn):
            raise TypeError(f"register_estimator({name!r}) decorates a function, got {fn!r}")
        taken = _ESTIMATORS.get(name)
        if taken is not None:
            if taken.fn is fn:
                return fn
            raise ValueError(
                f"estimator {name!r} is already registered by {taken.module}.{taken.fn.__qualname__}; "
                f"cannot register {fn.__module__}.{fn.__qualname__} under the same name"
            )
        estimator = Estimator(
            name, fn, needs_critic, tuple(options), formula or docstring_formula(fn), horizon,
            returns_minus_values, reads_lam(fn) if uses_lam is None else uses_lam, compared_at, label,
        )  # fmt: skip
        _ESTIMATORS[name] = estimator
        try:
            for listener in list(_LISTENERS):
                listener(estimator)
        except Exception:  # verl refused the name: it is not registered anywhere
            del _ESTIMATORS[name]
            raise
        return fn

    return decorator


def name_of(adv_estimator: Any) -> str:
    """The estimator's name from ``algorithm.adv_estimator``: verl passes a plain string or an
    ``AdvantageEstimator`` enum member."""
    return str(getattr(adv_estimator, "value", adv_estimator))


def lookup(name: str) -> Estimator | None:
    """The entry for ``name``: one of verl's that verl-ext describes, or a verl-ext estimator; None
    for a name verl-ext knows nothing about. verl's description wins: in a run, verl refuses to let
    anyone else take its names, so a trace of ``gae`` is verl's gae even where a process without the
    plugin registered a function under that name."""
    return _VERL_ESTIMATORS.get(name) or _ESTIMATORS.get(name)


def get(name: str) -> Estimator:
    """The entry for ``name`` (:func:`lookup`); ValueError listing the known names otherwise."""
    estimator = lookup(name)
    if estimator is None:
        known = ", ".join((*names(), *_VERL_ESTIMATORS))
        raise ValueError(f"{name!r} is not an estimator verl-ext knows; known: {known}")
    return estimator


def names() -> tuple[str, ...]:
    """verl-ext's own estimators: the ones it computes and registers into verl."""
    return tuple(_ESTIMATORS)


def all_estimators() -> tuple[Estimator, ...]:
    """verl-ext's own estimators, in registration order (built-ins first)."""
    return tuple(_ESTIMATORS.values())


def describe_verl_estimator(
    name: str,
    fn: EstimatorFn | None = None,
    *,
    needs_critic: bool,
    verl_whitens: bool | None = None,
    formula: str = "",
    horizon: Callable[[Settings], tuple[float, float]] | None = None,
    returns_minus_values: Callable[[Settings], bool] | None = None,
    label: Callable[[Settings], str] | None = None,
) -> None:
    """Describe verl's own estimator ``name`` (verl computes it; nothing is registered into verl):
    ``fn`` recomputes it from a trace like a registered estimator's (None: it cannot be), the rest as
    in :class:`Estimator`."""
    _VERL_ESTIMATORS[name] = Estimator(
        name, fn, needs_critic, (), formula, horizon, returns_minus_values, label=label, computed_by_verl=True, verl_whitens=verl_whitens,
    )  # fmt: skip


#: How an estimator function can reach λ: its ``lam`` argument, or ``config``, which holds ``lam`` too.
_LAM_CARRIERS = frozenset({"lam", "config"})


def reads_lam(fn: Callable) -> bool:
    """Whether ``fn`` may read ``algorithm.lam``: its code (nested functions included) loads its ``lam``
    or ``config`` argument, or a ``**kwargs`` that would hold them. True when that cannot be told (not a
    plain Python function): a description then names λ rather than hide one that matters."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return True
    carriers = set(_LAM_CARRIERS)
    if code.co_flags & inspect.CO_VARKEYWORDS:  # the name of **kwargs: after the named arguments
        carriers.add(code.co_varnames[code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)])
    codes = [code]
    while codes:
        current = codes.pop()
        codes += [constant for constant in current.co_consts if isinstance(constant, types.CodeType)]
        for instruction in dis.get_instructions(current):
            if instruction.opname.startswith("LOAD_") and instruction.argval in carriers:
                return True
    return False


def on_register(listener: Callable[[Estimator], None]) -> None:
    """Call ``listener(estimator)`` for every estimator registered from now on."""
    _LISTENERS.append(listener)


def run(
    estimator: Estimator,
    rewards: torch.Tensor,
    values: torch.Tensor | None,
    response_mask: torch.Tensor,
    settings: Settings,
    whiten: bool | None = None,
    truncation: Truncation | None = None,
) -> Estimate:
    """The estimator on one batch, whitened as ``settings`` say (or as ``whiten`` overrides), with cut
    responses treated as ``truncation`` says (None: terminal): the one code path of training,
    checking and comparing."""
    if estimator.needs_critic and values is None:
        raise MissingCriticValues(f"estimator {estimator.name!r} needs the critic's values, and there are none")
    if truncation is not None:
        rewards = truncation.rewards(rewards, response_mask, settings["gamma"])
    returns, raw = estimator.fn(
        rewards, values, response_mask, gamma=settings["gamma"], lam=settings["lam"], config=settings
    )
    for label, tensor in (("returns", returns), ("advantage_raw", raw)):
        if not isinstance(tensor, torch.Tensor) or tensor.shape != rewards.shape:
            shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ValueError(f"estimator {estimator.name!r} returned {label} of shape {shape}, expected {tuple(rewards.shape)}")
    whitened = settings["whiten_advantages"] if whiten is None else whiten
    if not whitened:
        return Estimate(returns, raw, raw if truncation is None else truncation.advantages(raw))
    kept = response_mask if truncation is None else truncation.whitened_mask(response_mask)
    if truncation is not None and truncation.mode == "mask" and int((kept != 0).sum()) < 2:
        return Estimate(returns, raw, torch.zeros_like(raw))  # no statistics, no advantage (Truncation.whiten)
    advantages, mean, var = estimators.whitened_with_moments(raw, kept)
    advantages = advantages if truncation is None else truncation.advantages(advantages)
    return Estimate(returns, raw, advantages, {"mean": mean, "var": var})


def whitening_statistics(raw: torch.Tensor | None, response_mask: torch.Tensor, truncation: Truncation | None = None) -> dict[str, float] | None:
    """{"mean": μ, "var": σ²} of ``raw`` as ``masked_whiten`` computes them (sums in float64, σ²
    unbiased: :func:`verl_ext.estimators.whitening_moments`), over the tokens whitening uses: the
    response mask, less the cut responses under ``algorithm.truncation=mask``. raw, response_mask:
    (B, T). None without ``raw`` or with fewer than 2 such tokens (where ``masked_whiten`` raises)."""
    if raw is None:
        return None
    mask = response_mask if truncation is None else truncation.whitened_mask(response_mask)
    count, mean, var = estimators.whitening_moments(raw, mask)
    return {"mean": mean, "var": var} if count >= 2 else None


def check_algorithm(algorithm: Any) -> dict[str, Any] | None:
    """Validate the estimator options of a run on the driver, whatever estimator it uses.

    Every option verl-ext knows is parsed when set (a bad value is a ValueError for any estimator);
    one that the chosen estimator ignores warns (verl's own read ``truncation``). Returns the settings
    of a verl-ext estimator, None for verl's own ones.
    """
    settings = algorithm_settings(algorithm)
    name = name_of(settings.get("adv_estimator"))
    chosen = _ESTIMATORS.get(name)
    known = {option.key: option for option in (*ALGORITHM_OPTIONS, *(o for e in all_estimators() for o in e.options))}
    described = lookup(name)
    read = {option.key for option in described.all_options} if described else set()
    for key, option in known.items():
        option.read(settings)  # raises for an invalid value, whether or not it is used
    ignored = sorted(k for k, o in known.items() if settings.get(k) is not None and k not in read and settings.get(k) != o.default)
    if ignored:
        warnings.warn(f"algorithm.adv_estimator={name} ignores " + ", ".join(f"algorithm.{k}" for k in ignored), stacklevel=2)
    return chosen.settings(settings) if chosen else None


def _short(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# --------------------------------------------------------------------------- the built-ins, registered

for _name, _fn, _entry in builtin_estimators.BUILTINS:
    register_estimator(_name, **_entry)(_fn)
for _name, _fn, _entry in builtin_estimators.VERL_DESCRIBED:
    describe_verl_estimator(_name, _fn, **_entry)

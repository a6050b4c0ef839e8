"""The built-in entries of the estimator registry: verl-ext's own estimators, with the keywords a user
gives ``register_estimator``, and the verl estimators verl-ext describes (``gae``, ``grpo``). The
formulas are in :mod:`verl_ext.estimators`; an entry adds what the registry needs to know.
:mod:`verl_ext.registry` registers them when it is imported (this module imports nothing of it)."""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from verl_ext import estimators
from verl_ext.options import LAM_ACTOR, LAM_CRITIC, LAM_LENGTH_ALPHA, N_STEP

Settings = Mapping[str, Any]

#: verl-ext's own estimators in registration order: (name, fn, keywords of ``register_estimator``).
BUILTINS: list[tuple[str, Callable, dict[str, Any]]] = []
#: verl's estimators verl-ext describes: (name, fn or None, keywords of ``describe_verl_estimator``).
VERL_DESCRIBED: list[tuple[str, Callable | None, dict[str, Any]]] = []


def builtin(name: str, **entry: Any) -> Callable:
    """Mark ``fn`` a built-in named ``name``, with ``entry`` as ``register_estimator``'s keywords."""

    def mark(fn: Callable) -> Callable:
        BUILTINS.append((name, fn, entry))
        return fn

    return mark


def verl_described(name: str, fn: Callable | None = None, **entry: Any) -> None:
    """Describe verl's estimator ``name``, with ``entry`` as ``describe_verl_estimator``'s keywords."""
    VERL_DESCRIBED.append((name, fn, entry))


def docstring_formula(fn: Callable) -> str:
    """The first paragraph of ``fn``'s docstring on one line: an estimator's formula where it is
    written once, beside its code (the built-ins' are in :mod:`verl_ext.estimators`)."""
    return " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())


def _discount_horizon(decay: float) -> float:
    """Terms a discounted sum with this decay effectively adds up: 1/(1 − decay), inf at 1."""
    return math.inf if decay >= 1.0 else 1.0 / (1.0 - decay)


# --------------------------------------------------------------------------- the built-in estimators


@builtin(
    "mc",
    formula=docstring_formula(estimators.mc),
    horizon=lambda s: (_discount_horizon(s["gamma"]),) * 2,
    returns_minus_values=lambda s: True,
    uses_lam=False,
)
def mc(rewards, values, response_mask, *, gamma, lam, config):
    return estimators.mc(rewards, values, response_mask, gamma)


@builtin(
    "td0",
    uses_lam=False,
    formula=docstring_formula(estimators.td0),
    horizon=lambda s: (1.0, 1.0),  # one reward, then V(s_{t+1})
    returns_minus_values=lambda s: True,
)
def td0(rewards, values, response_mask, *, gamma, lam, config):
    return estimators.td0(rewards, values, response_mask, gamma)


@builtin(
    "nstep",
    options=(N_STEP,),
    formula=docstring_formula(estimators.nstep),
    horizon=lambda s: (float(s["n_step"]),) * 2,
    returns_minus_values=lambda s: True,
    uses_lam=False,
    compared_at=lambda n, lambdas: ({"n_step": n},),
    label=lambda s: f"nstep{s['n_step']}",
)
def nstep(rewards, values, response_mask, *, gamma, lam, config):
    return estimators.nstep(rewards, values, response_mask, gamma, config["n_step"])


def _lam_critic(settings: Settings) -> float:
    """λ of the returns: ``lam_critic``, else ``lam``."""
    return settings["lam"] if settings.get("lam_critic") is None else settings["lam_critic"]


def _gae_lambdas(settings: Settings) -> tuple[float, float | None]:
    """(λ_critic, λ_actor), λ_actor None when length-adaptive."""
    lam = settings["lam"]
    critic = _lam_critic(settings)
    if settings.get("lam_length_alpha") is not None:
        return critic, None
    return critic, lam if settings.get("lam_actor") is None else settings["lam_actor"]


def _gae_ext_horizon(settings: Settings) -> tuple[float, float]:
    critic, actor = _gae_lambdas(settings)
    gamma = settings["gamma"]
    # a length-adaptive λ_actor has a horizon below L; L itself is the safe bound
    return _discount_horizon(gamma * critic), math.inf if actor is None else _discount_horizon(gamma * actor)


@builtin(
    "gae_ext",
    options=(LAM_CRITIC, LAM_ACTOR, LAM_LENGTH_ALPHA),
    formula=f"{docstring_formula(estimators.gae_decoupled)} Length-adaptive λ_actor: {docstring_formula(estimators.length_adaptive_lam)}",
    horizon=_gae_ext_horizon,
    returns_minus_values=lambda s: _gae_lambdas(s)[0] == _gae_lambdas(s)[1],
    compared_at=lambda n, lambdas: tuple({"lam": lam} for lam in lambdas),
    # one λ is plain GAE(λ), the column of that λ; decoupled or length-adaptive λs are gae_ext's own
    label=lambda s: f"gae{_gae_lambdas(s)[1]:g}" if _gae_lambdas(s)[0] == _gae_lambdas(s)[1] else "gae_ext",
)
def gae_ext(rewards, values, response_mask, *, gamma, lam, config):
    lam_critic, lam_actor = _gae_lambdas({**config, "lam": lam})
    if lam_actor is None:
        lam_actor = estimators.length_adaptive_lam(response_mask, config["lam_length_alpha"]).to(rewards.device)
    elif lam_actor == lam_critic:
        return estimators.gae(rewards, values, response_mask, gamma, lam_actor)
    return estimators.gae_decoupled(rewards, values, response_mask, gamma, lam_critic, lam_actor)


@builtin(
    "turn_gae",
    options=(LAM_CRITIC,),
    formula=docstring_formula(estimators.turn_gae),
    # the advantage sums whole turns of rewards: up to the row's length whatever γλ
    horizon=lambda s: (_discount_horizon(s["gamma"] * _lam_critic(s)), math.inf),
    # the actor's A_k is per turn, the critic's target per token: never returns − values
    returns_minus_values=lambda s: False,
    # one column, λ = 1 (λ weighs turns against each other: on single-turn responses every λ gives Σr − V_0)
    compared_at=lambda n, lambdas: ({"lam": 1.0},),
    label=lambda s: "turn_gae" if s["lam"] == 1.0 else f"turn_gae{s['lam']:g}",
)
def turn_gae(rewards, values, response_mask, *, gamma, lam, config):
    return estimators.turn_gae(rewards, values, response_mask, gamma, lam, _lam_critic({**config, "lam": lam}))


# --------------------------------------------------------------------------- verl's estimators, described


def _verl_gae(rewards, values, response_mask, *, gamma, lam, config):
    return estimators.gae(rewards, values, response_mask, gamma, lam)


verl_described(
    "gae",
    _verl_gae,
    needs_critic=True,
    verl_whitens=True,  # verl's GAE always whitens
    formula=docstring_formula(estimators.gae),
    horizon=lambda s: (_discount_horizon(s["gamma"] * s["lam"]),) * 2,
    returns_minus_values=lambda s: True,
    label=lambda s: f"gae{s['lam']:g}",
)
# not recomputable: its advantages come from group statistics the trace does not hold
verl_described(
    "grpo", needs_critic=False, formula="advantage = (score − its prompt group's mean) / (the group's std + ε), on every token"
)

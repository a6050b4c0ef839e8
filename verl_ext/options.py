"""The options verl-ext reads from a verl config: parsed, defaulted and validated in one place.

Estimator options live in verl's ``algorithm`` node next to ``gamma`` and ``lam``; trace options
in a top-level ``verl_ext.trace`` node. Both are read from any mapping with ``.get`` (an
OmegaConf ``DictConfig`` or a plain dict), so this module imports neither verl nor OmegaConf.
Every error is a ``ValueError`` that names the config key and the offending value.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, Mapping

#: The value-based estimators this package adds to ``algorithm.adv_estimator``.
ESTIMATOR_NAMES = ("mc", "td0", "nstep", "gae_ext")

#: Keys this package adds under ``algorithm`` (declared with these defaults in configs/).
ALGORITHM_KEYS = {
    "n_step": None,
    "lam_critic": None,
    "lam_actor": None,
    "lam_length_alpha": None,
    "whiten_advantages": True,
}

#: Which added key each estimator reads; setting another is almost certainly a mistake.
_USES = {
    "mc": set(),
    "td0": set(),
    "nstep": {"n_step"},
    "gae_ext": {"lam_critic", "lam_actor", "lam_length_alpha"},
}


@dataclass(frozen=True)
class EstimatorOptions:
    """Everything an estimator needs besides tensors."""

    name: str
    gamma: float = 1.0
    lam: float = 1.0
    n_step: int | None = None
    lam_critic: float | None = None
    lam_actor: float | None = None
    lam_length_alpha: float | None = None
    whiten_advantages: bool = True

    @property
    def critic_lam(self) -> float:
        """λ of the returns (the critic's target)."""
        return self.lam if self.lam_critic is None else self.lam_critic

    @property
    def actor_lam(self) -> float:
        """λ of the advantages, when not length-adaptive."""
        return self.lam if self.lam_actor is None else self.lam_actor

    @property
    def single_lambda(self) -> bool:
        """True when returns − values = raw advantage (docs/definitions.md §4)."""
        return self.lam_length_alpha is None and self.critic_lam == self.actor_lam

    @classmethod
    def from_config(cls, algorithm: Mapping[str, Any]) -> "EstimatorOptions":
        """Read and validate the options of ``algorithm.adv_estimator`` (one of ESTIMATOR_NAMES)."""
        name = algorithm.get("adv_estimator")
        if name not in ESTIMATOR_NAMES:
            raise ValueError(
                f"algorithm.adv_estimator={name!r} is not a verl-ext estimator; expected one of {list(ESTIMATOR_NAMES)}"
            )
        values = {key: algorithm.get(key, default) for key, default in ALGORITHM_KEYS.items()}
        options = cls(
            name=name,
            gamma=_unit_interval("algorithm.gamma", algorithm.get("gamma", 1.0)),
            lam=_unit_interval("algorithm.lam", algorithm.get("lam", 1.0)),
            n_step=_optional(_positive_int, "algorithm.n_step", values["n_step"]),
            lam_critic=_optional(_unit_interval, "algorithm.lam_critic", values["lam_critic"]),
            lam_actor=_optional(_unit_interval, "algorithm.lam_actor", values["lam_actor"]),
            lam_length_alpha=_optional(_positive_float, "algorithm.lam_length_alpha", values["lam_length_alpha"]),
            whiten_advantages=_boolean("algorithm.whiten_advantages", values["whiten_advantages"]),
        )
        if name == "nstep" and options.n_step is None:
            raise ValueError("algorithm.adv_estimator=nstep needs algorithm.n_step (an integer >= 1)")
        unused = [key for key in sorted(set().union(*_USES.values()) - _USES[name]) if values[key] is not None]
        if unused:
            warnings.warn(
                f"algorithm.adv_estimator={name} ignores " + ", ".join(f"algorithm.{k}" for k in unused),
                stacklevel=2,
            )
        return options


#: Keys of the ``verl_ext.trace`` node, with defaults.
TRACE_KEYS = {
    "dir": None,
    "every": 1,
    "max_samples_per_step": None,
    "on_error": "warn",
    "queue_size": 2,
}


@dataclass(frozen=True)
class TraceOptions:
    """Where and how often the per-token trace is written; ``dir=None`` means off."""

    dir: str | None = None
    every: int = 1
    max_samples_per_step: int | None = None
    on_error: str = "warn"
    queue_size: int = 2

    def __post_init__(self) -> None:
        """Every TraceOptions is valid, however it was made (ValueError naming the key otherwise)."""
        if self.on_error not in ("warn", "raise"):
            raise ValueError(f"verl_ext.trace.on_error must be 'warn' or 'raise', got {self.on_error!r}")
        if self.dir is not None and (not isinstance(self.dir, str) or not self.dir):
            raise ValueError(f"verl_ext.trace.dir must be a non-empty path or URL, got {self.dir!r}")
        _positive_int("verl_ext.trace.every", self.every)
        _positive_int("verl_ext.trace.queue_size", self.queue_size)
        _optional(_positive_int, "verl_ext.trace.max_samples_per_step", self.max_samples_per_step)

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def traces_step(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "TraceOptions":
        """Read ``verl_ext.trace`` from the root config; an absent node means tracing is off."""
        verl_ext_node = config.get("verl_ext") or {}
        node = verl_ext_node.get("trace") or {}
        unknown = sorted(set(verl_ext_node) - {"trace"}) + sorted(f"trace.{k}" for k in set(node) - set(TRACE_KEYS))
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join('verl_ext.' + k for k in unknown)}; "
                f"verl_ext.trace takes {', '.join(TRACE_KEYS)}"
            )
        return cls(**{key: node.get(key, default) for key, default in TRACE_KEYS.items()})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _optional(parse, key: str, value: Any):
    return None if value is None else parse(key, value)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def _unit_interval(key: str, value: Any) -> float:
    number = _number(key, value)
    if not 0.0 <= number <= 1.0:
        raise ValueError(f"{key} must be in [0, 1], got {value!r}")
    return number


def _positive_float(key: str, value: Any) -> float:
    number = _number(key, value)
    if not number > 0:
        raise ValueError(f"{key} must be > 0, got {value!r}")
    return number


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
    return value


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value

"""What a run record says about how the trace's returns and advantages were made.

The checker recomputes returns and raw advantages with the estimator and options the run used,
read from ``_run.json`` (``record["algorithm"]``). verl-ext's own estimators (``mc``, ``td0``,
``nstep``, ``gae_ext``) carry all their options there; verl's ``gae`` is single-λ GAE that always
whitens. Any other estimator (``grpo``, ``rloo``, …) builds advantages from group statistics the
trace does not hold, so those identities are reported as not applicable, never as passed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from verl_ext.errors import TraceError
from verl_ext.options import ESTIMATOR_NAMES, EstimatorOptions


@dataclass(frozen=True)
class RecordedAlgorithm:
    """The estimator of a run, in the form the checker needs."""

    estimator: str
    gamma: float
    #: How to recompute returns and raw advantages; None when the trace cannot tell (see ``why_not``).
    options: EstimatorOptions | None
    why_not: str | None
    #: True/False: advantages are (not) masked_whiten(raw advantage); None: not applicable.
    whitened: bool | None
    kl_in_reward: bool
    kl_penalty: str | None

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "RecordedAlgorithm":
        algorithm = record.get("algorithm")
        if not isinstance(algorithm, Mapping) or not algorithm.get("adv_estimator"):
            raise TraceError("run record has no algorithm.adv_estimator")
        name = str(algorithm["adv_estimator"])
        kl = dict(kl_in_reward=bool(algorithm.get("use_kl_in_reward", False)), kl_penalty=algorithm.get("kl_penalty"))
        if name not in ESTIMATOR_NAMES and name != "gae":
            gamma = float(algorithm.get("gamma", 1.0))
            why = f"verl's {name!r} estimator: its advantages come from statistics the trace does not hold"
            return cls(name, gamma, None, why, None, **kl)
        for key in ("gamma", "lam"):
            if not isinstance(algorithm.get(key), (int, float)):
                raise TraceError(f"run record: algorithm.{key} is {algorithm.get(key)!r}, expected a number")
        if name == "gae":  # verl's GAE: one λ, advantages always whitened
            options = EstimatorOptions(name="gae_ext", gamma=float(algorithm["gamma"]), lam=float(algorithm["lam"]))
        else:
            try:
                options = EstimatorOptions.from_config(algorithm)
            except ValueError as exc:
                raise TraceError(f"run record: {exc}") from None
        return cls(name, options.gamma, options, None, options.whiten_advantages, **kl)

    @property
    def single_lambda(self) -> bool:
        """True when returns − values = raw advantage on valid tokens (docs/definitions.md §4)."""
        return self.options is not None and (self.options.name != "gae_ext" or self.options.single_lambda)

    def returns_formula(self) -> str:
        o = self.options
        if o is None:
            return "returns"
        if o.name == "mc":
            return f"returns = Σ γ^k r (γ={o.gamma:g})"
        if o.name == "td0":
            return f"returns = r + γV' (γ={o.gamma:g})"
        if o.name == "nstep":
            return f"returns = n-step (n={o.n_step}, γ={o.gamma:g})"
        return f"returns = GAE(γ={o.gamma:g}, λ={o.critic_lam:g}) + V"

    def raw_formula(self) -> str:
        if self.single_lambda or self.options is None:
            return "raw advantage = returns − values"
        o = self.options
        lam = f"1−1/({o.lam_length_alpha:g}·L)" if o.lam_length_alpha is not None else f"{o.actor_lam:g}"
        return f"raw advantage = GAE(γ={o.gamma:g}, λ={lam})"

    def describe(self) -> str:
        """One line: the estimator and the settings the identities depend on."""
        parts = [self.estimator]
        if self.options is not None:
            parts.append(self.returns_formula().removeprefix("returns = "))
            if not self.single_lambda:
                parts.append("actor: " + self.raw_formula().removeprefix("raw advantage = "))
        parts.append({True: "whitened", False: "not whitened", None: "no whitening check"}[self.whitened])
        parts.append(f"KL in reward ({self.kl_penalty})" if self.kl_in_reward else "no KL in reward")
        return ", ".join(parts)


def step_beta(step_record: Mapping[str, Any]) -> float | None:
    """β applied at a step (``kl_coef``), or None if the record has none."""
    beta = step_record.get("kl_coef")
    return float(beta) if isinstance(beta, (int, float)) else None

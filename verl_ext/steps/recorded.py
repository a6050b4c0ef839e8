"""What the run record says about how a trace was made: the run's estimator and settings
(:class:`RecordedAlgorithm`), whether the run finished and its rollout engine (:class:`RecordedRun`).

* :class:`RecordedAlgorithm`: the run's estimator and settings, from ``_run.json``, resolved by its
  entry in :mod:`verl_ext.registry` (verl's own estimators too: ``gae`` is recomputed, always
  whitened; ``grpo`` and the others build advantages from group statistics the trace does not hold),
  and its ``algorithm.truncation`` (docs/definitions.md#truncated-responses; a run record before
  format 7 has none: terminal, what every run did then);
* :class:`RecordedRun`: whether the run finished, the steps it planned and the engine that generated
  its responses (a run record before format 8 says none of these: unknown).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from verl_ext.errors import TraceError
from verl_ext.options import TRUNCATION_DEFAULT, TRUNCATION_MODES

# --------------------------------------------------------------------------- the run's estimator


@dataclass(frozen=True)
class RecordedAlgorithm:
    """The estimator of a run, in the form the checker needs."""

    name: str
    gamma: float
    #: The registered estimator that recomputes returns and raw advantages, and its settings; None
    #: when the trace cannot tell (see ``why_not``).
    estimator: Any
    settings: Mapping[str, Any] | None
    why_not: str | None
    #: True/False: advantages are (not) masked_whiten(raw advantage); None: not applicable.
    whitened: bool | None
    kl_in_reward: bool
    kl_penalty: str | None
    #: True when the run's estimator is not in this process (its module did not import here): the
    #: identities that recompute it apply to the run but are not checked (``why_not`` says why).
    estimator_missing: bool = False
    #: ``algorithm.truncation``: what the estimate did with the responses cut at the length limit.
    truncation: str = TRUNCATION_DEFAULT
    #: verl's name of the rollout that made the responses (None: a trace before format 8).
    rollout: str | None = None
    #: ``algorithm.rollout_correction`` (:class:`verl_ext.rollout_correction.Correction`); None: the run
    #: corrects nothing, or a trace before format 10
    correction: Any = None
    #: the rollout's truncated sampling (:func:`truncated_sampling`), None where it sampled from the whole distribution
    truncated_sampling: str | None = None
    #: how the trainer overlapped generation and training (RunRecord.mode: {"name", settings}); None: a trace
    #: before format 11 (synchronous)
    mode: Mapping[str, Any] | None = None

    @classmethod
    def from_record(cls, record) -> "RecordedAlgorithm":
        from verl_ext import registry

        algorithm = record.algorithm
        if not isinstance(algorithm, Mapping) or not algorithm.get("adv_estimator"):
            raise TraceError("run record has no algorithm.adv_estimator")
        name = str(algorithm["adv_estimator"])
        recorded = dict(
            kl_in_reward=bool(algorithm.get("use_kl_in_reward", False)),
            kl_penalty=algorithm.get("kl_penalty"),
            truncation=recorded_truncation(algorithm),
            rollout=(getattr(record, "rollout", None) or {}).get("name"),
            correction=recorded_correction(algorithm),
            truncated_sampling=truncated_sampling(getattr(record, "rollout", None)),
            mode=getattr(record, "mode", None) if isinstance(getattr(record, "mode", None), Mapping) else None,
        )
        gamma = algorithm.get("gamma", 1.0)
        for key in ("gamma", "lam"):
            if not isinstance(algorithm.get(key, 1.0), (int, float)):
                raise TraceError(f"run record: algorithm.{key} is {algorithm.get(key)!r}, expected a number")
        estimator = registry.lookup(name)
        module = algorithm.get("estimator_module")
        if estimator is None and module:
            problem = _import_problem(str(module))  # a user's estimator, registered on import
            estimator = registry.lookup(name)
            if estimator is None:
                why = (
                    f"estimator {name!r} is not importable here: {problem}"
                    if problem
                    else f"estimator {name!r} is not registered by its module {module!r} as imported here"
                )
                whitened = algorithm.get("whiten_advantages")  # recorded: whitening is checked without the estimator
                whitened = whitened if isinstance(whitened, bool) else None
                return cls(name, float(gamma), None, None, why, whitened, **recorded, estimator_missing=True)
        if estimator is None or not estimator.recomputable:
            why = f"verl's {name!r} estimator: its advantages come from statistics the trace does not hold"
            return cls(name, float(gamma), None, None, why, None, **recorded)
        try:
            settings = estimator.settings(algorithm)
        except ValueError as exc:
            raise TraceError(f"run record: {exc}") from None
        return cls(name, float(gamma), estimator, settings, None, settings["whiten_advantages"], **recorded)

    @property
    def asynchronous(self) -> bool:
        """The run overlapped generation and training (its record names a mode other than sync)."""
        return self.mode is not None and self.mode.get("name") not in (None, "sync")

    @property
    def recomputable(self) -> bool:
        return self.estimator is not None

    @property
    def returns_minus_values(self) -> bool:
        """True when returns − values = raw advantage on valid tokens (docs/definitions.md §4)."""
        return self.estimator is not None and self.estimator.is_returns_minus_values(self.settings)

    def describe_estimator(self) -> str:
        """``nstep(γ=0.99, n_step=3)``, ``gae(γ=1, λ=0.95)``; the bare name when not recomputable."""
        return self.name if self.estimator is None else self.estimator.describe(self.settings)

    def describe(self) -> str:
        """One line: the estimator and the settings the identities depend on."""
        parts = [self.describe_estimator()]
        parts.append({True: "whitened", False: "not whitened", None: "no whitening check"}[self.whitened])
        parts.append(f"KL in reward ({self.kl_penalty})" if self.kl_in_reward else "no KL in reward")
        if self.truncation != TRUNCATION_DEFAULT:
            parts.append(f"truncation={self.truncation}")
        return ", ".join(parts)


#: The format whose run record first says whether the run finished, and its rollout engine.
RUN_END_SINCE = 8


@dataclass(frozen=True)
class RecordedRun:
    """What the run record says about the run as a whole: whether it finished, the steps it planned,
    the last step the trace holds, and the rollout engine."""

    #: True: the trainer's fit() returned after its last step; False: it did not (killed, interrupted,
    #: failed, or still running); None: the record does not say (a trace before format 8)
    finished: bool | None
    planned_steps: int | None
    #: the last step the trace holds, on disk or listed in the run record (None: no step)
    last_step: int | None
    #: {"name", "version", "dtype"}; None: not recorded
    rollout: Mapping[str, Any] | None
    schema_version: int

    @classmethod
    def of(cls, trace) -> "RecordedRun":
        record = trace.record
        steps = set(trace.steps) | {int(step) for step in record.steps}
        finished = record.finished if isinstance(record.finished, bool) else None
        planned = record.planned_steps if isinstance(record.planned_steps, int) else None
        rollout = record.rollout if isinstance(record.rollout, Mapping) else None
        return cls(finished, planned, max(steps) if steps else None, rollout, record.schema_version)

    def _not_recorded(self) -> str:
        return f"a trace before format {RUN_END_SINCE}" if self.schema_version < RUN_END_SINCE else "the run record does not say"

    def describe_rollout(self) -> str:
        """``vllm 0.27.0+cpu, float32``; what is not known said as such."""
        if self.rollout is None:
            return f"not recorded ({self._not_recorded()})"
        name = self.rollout.get("name") or "unknown engine"
        version = self.rollout.get("version")
        dtype = self.rollout.get("dtype")
        engine = f"{name} {version}" if version else f"{name} (version unknown)"
        return f"{engine}, {dtype}" if dtype else engine

    def steps_done(self) -> str:
        """``8 of 40 planned steps``: the last step the trace holds of those planned."""
        if self.planned_steps is None:
            return "planned steps unknown" if self.last_step is None else f"last step {self.last_step}, planned steps unknown"
        return f"{self.last_step or 0} of {self.planned_steps} planned steps"

    def describe_end(self) -> str:
        """Whether the run finished, in a few words: ``no: 8 of 40 planned steps``."""
        if self.finished is None:
            return f"unknown ({self._not_recorded()})"
        if self.finished:
            return "yes" if self.planned_steps is None else f"yes ({self.planned_steps} planned steps)"
        return f"no: {self.steps_done()}"

    def unfinished(self) -> str | None:
        """``8 of 40 planned steps; the run did not finish`` for a run that did not finish, else None."""
        return None if self.finished is not False else f"{self.steps_done()}; the run did not finish"


def recorded_truncation(algorithm: Mapping[str, Any]) -> str:
    """The run record's ``algorithm.truncation``: terminal where it has none (a trace before format 7,
    or a run of an estimator verl-ext does not know); TraceError for a value no run writes."""
    mode = algorithm.get("truncation")
    if mode is None:
        return TRUNCATION_DEFAULT
    if mode not in TRUNCATION_MODES:
        raise TraceError(f"run record: algorithm.truncation is {mode!r}, expected one of {', '.join(TRUNCATION_MODES)}")
    return str(mode)


def truncated_sampling(rollout: Mapping[str, Any] | None) -> str | None:
    """``top_p 0.8, top_k 50`` where the run record's rollout sampled from a truncated distribution, whose
    renormalised log-probs bias the ratio π_old/π_rollout (docs/definitions.md#off-policy-tokens); None
    where it did not, or the record does not say (a trace before format 10)."""
    rollout = rollout or {}
    top_p, top_k = rollout.get("top_p"), rollout.get("top_k")
    said = []
    if isinstance(top_p, (int, float)) and top_p < 1:
        said.append(f"top_p {top_p:g}")
    if isinstance(top_k, int) and top_k > 0:
        said.append(f"top_k {top_k}")
    return ", ".join(said) or None


def recorded_correction(algorithm: Mapping[str, Any]):
    """The run record's ``algorithm.rollout_correction``: None where it has none (a trace before format
    10, or a run that corrects nothing); TraceError for settings no run writes."""
    from verl_ext.rollout_correction import Correction

    settings = algorithm.get("rollout_correction")
    if settings is None:
        return None
    try:
        return Correction.from_settings(settings)
    except (ValueError, TypeError, KeyError) as error:
        raise TraceError(f"run record: algorithm.rollout_correction: {error}") from None


def _import_problem(module: str) -> str | None:
    """Import a user's module as the CLI does; None when it imported, else why not (one line)."""
    from verl_ext.options import import_user_module, user_module_problem

    try:
        import_user_module(module)
    except Exception as error:  # noqa: BLE001 - the caller reports it as an estimator not checked
        return user_module_problem(module, error)
    return None


def step_beta(step_record) -> float | None:
    """β applied at a step (``kl_coef``), or None if the record has none."""
    beta = getattr(step_record, "kl_coef", None)
    return float(beta) if isinstance(beta, (int, float)) else None

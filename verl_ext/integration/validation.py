"""Checks of a verl config that verl itself does not make, run on the driver before Ray starts."""

from __future__ import annotations

from typing import Any

from verl_ext import registry
from verl_ext.options import TRUNCATION, TRUNCATION_DEFAULT, TraceOptions, algorithm_settings, metrics_enabled, nonfinite_mode


def known_estimator_names() -> set[str]:
    """Every name ``algorithm.adv_estimator`` accepts in this process: verl's and verl-ext's."""
    from verl.trainer.ppo import core_algos

    return (
        set(core_algos.ADV_ESTIMATOR_REGISTRY)
        | {member.value for member in core_algos.AdvantageEstimator}
        | set(registry.names())
    )


def critic_required(config: Any) -> bool:
    """True for a verl-ext estimator that needs the critic; an explicit ``critic.enable=False`` is an error."""
    name = registry.name_of(config.algorithm.adv_estimator)
    if name not in registry.names() or not registry.get(name).needs_critic:
        return False
    enable = (config.get("critic") or {}).get("enable", None)
    if enable is not None and not enable:
        needing = [e.name for e in registry.all_estimators() if e.needs_critic]
        raise ValueError(
            f"algorithm.adv_estimator={name} needs a critic (it uses the values V(s_t)), but critic.enable=False. "
            f"Remove critic.enable=False (verl-ext switches the critic on for {', '.join(needing)}) "
            "or choose an estimator that needs no critic."
        )
    return True


def check_truncation(algorithm: Any) -> None:
    """``algorithm.truncation`` (docs/definitions.md #truncated-responses) where verl-ext can apply it:
    an estimator it knows, a critic to bootstrap from, rows that verl does not resample after the estimate."""
    settings = algorithm_settings(algorithm)
    mode = TRUNCATION.read(settings)
    if mode == TRUNCATION_DEFAULT:
        return
    name = registry.name_of(settings.get("adv_estimator"))
    estimator = registry.lookup(name)
    if estimator is None:
        raise ValueError(
            f"algorithm.truncation={mode} needs an estimator verl-ext knows (its own, verl's gae or grpo); "
            f"verl computes algorithm.adv_estimator={name} without it: use algorithm.truncation=terminal"
        )
    if mode == "bootstrap" and not estimator.needs_critic:
        raise ValueError(
            f"algorithm.truncation=bootstrap bootstraps from the critic's value after a cut response, and "
            f"algorithm.adv_estimator={name} has no critic: use algorithm.truncation=mask to leave cut responses out"
        )
    if settings.get("use_pf_ppo"):
        raise ValueError(
            f"algorithm.truncation={mode} with algorithm.use_pf_ppo=True: verl resamples the rows after the estimate, "
            "so the cut responses cannot be followed; use algorithm.truncation=terminal or algorithm.use_pf_ppo=False"
        )


def check_config(config: Any) -> None:
    """Estimator name, estimator options, trace options, verl_ext.nonfinite and verl_ext.metrics; raises ValueError
    naming key and value."""
    algorithm = config.get("algorithm") or {}
    name = registry.name_of(algorithm.get("adv_estimator"))
    valid = known_estimator_names()
    if name not in valid:
        raise ValueError(
            f"algorithm.adv_estimator={name!r} is not a known advantage estimator. Valid names: {', '.join(sorted(valid))}"
        )
    check_truncation(algorithm)  # first: its error says why, where check_algorithm would warn that the option is ignored
    registry.check_algorithm(algorithm)
    critic_required(config)
    nonfinite_mode(config)
    metrics_enabled(config)
    trace = TraceOptions.from_config(config)
    if trace.enabled:
        check_trace_dir_writable(trace.dir)


def check_trace_dir_writable(directory: str) -> None:
    """That the trace directory can be written and no other writer holds it; leaves nothing behind
    (verl may still reject the config after this)."""
    from verl_ext.errors import UsageError
    from verl_ext.trace import lease, storage

    try:
        storage.check_writable(directory)
        lease.refuse_if_held(*storage.resolve(directory), directory)
    except UsageError as exc:
        raise ValueError(f"verl_ext.trace.dir: {exc}") from None

"""The identities of docs/definitions.md §8, one record each, in report order: :data:`IDENTITIES`.

An :class:`Identity` is everything about one identity: its name, its item of §8, the table it reads,
what it says and its tolerance (both may depend on the run), and its check. The checks of the token
table are in :mod:`~verl_ext.check.token_checks`, those of the update tables in
:mod:`~verl_ext.check.update_checks`; :func:`verl_ext.check.run.check_trace` runs them all, and the
report, its JSON and the browser view take names, sections and titles from here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from verl_ext.check import async_checks, correction_checks, update_checks
from verl_ext.check.results import ELEMENTWISE, EXACT, Tolerance
from verl_ext.steps.recorded import RecordedAlgorithm
from verl_ext.check.token_checks import ACCUMULATED, STATISTICS, WHITENING, TokenStep, steps_on_disk

__all__ = ["IDENTITIES", "Identity"]

#: The tables an identity reads: one step of the token table, one step of the update tables, or the
#: run record against the files (once per check, with a finding per step).
TOKEN, UPDATE, RUN = "token", "update", "run"
#: The rollouts whose engine says why it ended each response (the trace's ``stop_reason``).
STOP_REASON_ROLLOUTS = ("vllm",)


@dataclass(frozen=True)
class Identity:
    """One identity of docs/definitions.md §8, everything about it in one place."""

    name: str
    #: The item of docs/definitions.md §8 it checks, as printed ("8.2": §8, item 2).
    section: str
    #: TOKEN, UPDATE or RUN: which context ``check`` is given (TokenStep, UpdateStep, RunScope).
    table: str
    #: What it says; a function of the run's RecordedAlgorithm where that depends on the run.
    title: str | Callable[[RecordedAlgorithm], str]
    tolerance: Tolerance | Callable[[RecordedAlgorithm], Tolerance]
    #: context -> Finding (TOKEN, UPDATE: one step), or -> iterable of (step, Finding) (RUN).
    check: Callable[[Any], Any]
    #: What a violation counts, for "FAIL (3 tokens)".
    counts: str = "token"
    #: Whether the run has it (None: every run); one a run does not have is not in its report at all.
    applies: Callable[[RecordedAlgorithm], bool] | None = None

    def applies_to(self, algorithm: RecordedAlgorithm) -> bool:
        return self.applies is None or self.applies(algorithm)

    def describe(self, algorithm: RecordedAlgorithm) -> tuple[str, str]:
        """(title, tolerance text) for this run."""
        title = self.title if isinstance(self.title, str) else self.title(algorithm)
        tolerance = self.tolerance if isinstance(self.tolerance, Tolerance) else self.tolerance(algorithm)
        return title, tolerance.text


# --------------------------------------------------------------------------- the registry


def _at_the_cut(a: RecordedAlgorithm) -> str:
    """How the recomputation treats a cut response, for the titles of identities 1 and 3 ("" where its
    returns are the terminal ones: terminal, mask)."""
    return ", cut responses from their bootstrap_value" if a.truncation == "bootstrap" else ""


def _whitening_title(a: RecordedAlgorithm) -> str:
    if a.whitened is False:
        return "advantages = raw advantage (whitening off)" + (", 0 on cut responses" if a.truncation == "mask" else "")
    if a.truncation == "mask":
        return "advantages = masked_whiten(raw advantage) over responses not cut, 0 on cut ones"
    return "advantages = masked_whiten(raw advantage)"


def _weights_title(a: RecordedAlgorithm) -> str:
    c = a.correction
    band = f"IcePop [{c.is_lower:g}, {c.is_upper:g}]" if c.is_lower is not None else f"TIS ≤ {c.is_upper:g}"
    return f"rollout_is_weight = π_old/π_rollout recomputed ({c.rollout_is}, {band}{', batch-normalised' if c.batch_normalize else ''})"


def _rejection_title(a: RecordedAlgorithm) -> str:
    return f"rejected = the policy's tokens {', '.join(option.name for option in a.correction.rejection)} reject"


def _staleness_title(a: RecordedAlgorithm) -> str:
    mode = a.mode or {}
    if mode.get("name") == async_checks.FULLY_ASYNC:
        budget = int(mode["max_required_samples"]) - int(mode["required_samples"]) * int(mode["trigger_parameter_sync_step"])
        return f"at each weight sync ≤ {budget} prompts of older weights trained after it (staleness_threshold={mode['staleness_threshold']:g})"
    bound, _ = async_checks.staleness_bound(mode)
    return "staleness: no bound per response in this mode" if bound is None else f"staleness = trainer_version − policy_version_min ≤ {bound}"


def _accumulated(a: RecordedAlgorithm) -> bool:
    """The raw advantage is recomputed with the estimator (else it is checked as returns − values);
    an estimator missing here is named too, on the row that says it was not checked."""
    return (a.recomputable or a.estimator_missing) and not a.returns_minus_values


#: Every identity, in report order: the token table's on each step, the run record's once, then the
#: update tables' on each step (only for a trace that has update tables). To add one: write its check
#: (a method of :class:`~verl_ext.check.token_checks.TokenStep` for the token table, a function of an
#: :class:`~verl_ext.check.update_checks.UpdateStep` in :mod:`~verl_ext.check.update_checks`) and add its record
#: here; it is checked, reported and rendered from the record alone.
IDENTITIES = (
    Identity(
        "advantage_raw", "8.1", TOKEN,
        lambda a: f"raw advantage recomputed: {a.describe_estimator()}{_at_the_cut(a)}" if _accumulated(a) else "raw advantage = returns − values",
        lambda a: ACCUMULATED if _accumulated(a) else ELEMENTWISE,
        TokenStep.advantage_raw,
    ),
    Identity(
        "whitening", "8.2", TOKEN,
        _whitening_title,
        lambda a: ELEMENTWISE if a.whitened is False else WHITENING,
        TokenStep.whitening,
    ),
    Identity(
        "whitening_stats", "8.2", TOKEN,
        lambda a: "recorded whitening μ, σ = recomputed" + (" over responses not cut" if a.truncation == "mask" else ""),
        STATISTICS, TokenStep.whitening_stats, counts="statistic",
    ),
    Identity("returns", "8.3", TOKEN, lambda a: f"returns recomputed: {a.describe_estimator()}{_at_the_cut(a)}", ACCUMULATED, TokenStep.returns),
    Identity(
        "rewards", "8.4", TOKEN,
        lambda a: "rewards = scores + turn rewards − β·kl" if a.kl_in_reward else "rewards = scores + turn rewards (no KL in reward)",
        ELEMENTWISE, TokenStep.rewards,
    ),
    Identity("turn_rewards", "8.4", TOKEN, "per-turn rewards only on a turn's last token (§7)", EXACT, TokenStep.turn_rewards),
    Identity(
        "mask_layout", "8.5", TOKEN, "rows 0…n−1 per sample, ending on a valid token; count as recorded", EXACT,
        TokenStep.mask_layout, counts="row",
    ),
    Identity("turns", "8.5", TOKEN, "turn = the holes before the token (§7)", EXACT, TokenStep.turns, counts="row"),
    Identity("roles", "8.5", TOKEN, "role = assistant exactly on the policy's tokens (§7)", EXACT, TokenStep.roles, counts="row"),
    Identity("finite", "8.5", TOKEN, "quantities present and finite on valid tokens", EXACT, TokenStep.finite),
    Identity("steps_on_disk", "8.5", RUN, "every step and update table of the run record is on disk and reads", EXACT, steps_on_disk, counts="file"),
    # docs/definitions.md#truncated-responses: only in the report of a run that treats cut responses apart
    Identity(
        "bootstrap_value", "8.7", TOKEN, "bootstrap_value present exactly on cut responses", EXACT, TokenStep.bootstrap_value,
        counts="response", applies=lambda a: a.truncation == "bootstrap",
    ),
    Identity(
        "cut_advantage", "8.7", TOKEN, "cut responses have advantage 0", EXACT, TokenStep.cut_advantage,
        applies=lambda a: a.truncation == "mask",
    ),
    # only in the report of a run whose rollout engine says why it ended each response (verl_ext.integration.stop_reasons)
    Identity(
        "stop_reason", "8.7", TOKEN, "truncated where the rollout engine stopped at the length limit (its stop reason)", EXACT,
        TokenStep.stop_reason, counts="response", applies=lambda a: a.rollout in STOP_REASON_ROLLOUTS,
    ),
    # docs/definitions.md#off-policy-tokens: only in the report of a run with verl's rollout correction
    Identity(
        "is_weights", "8.8", TOKEN, _weights_title, correction_checks.WEIGHT, correction_checks.is_weights,
        applies=lambda a: a.correction is not None and a.correction.rollout_is is not None and not a.correction.bypass_mode,
    ),
    Identity(
        "rejection", "8.8", TOKEN, _rejection_title, correction_checks.THRESHOLD, correction_checks.rejection,
        applies=lambda a: a.correction is not None and bool(a.correction.rejection) and not a.correction.bypass_mode,
    ),
    Identity(
        "bypass", "8.8", TOKEN, "old_log_prob = rollout_log_prob (bypass mode)", EXACT, correction_checks.bypass,
        applies=lambda a: a.correction is not None and a.correction.bypass_mode,
    ),
    Identity(
        "offpolicy_logged", "8.8", TOKEN, "verl's logged rollout_corr/… and rollout_probs_diff_… numbers = the same definitions over the rows",
        correction_checks.LOGGED, correction_checks.logged_numbers, counts="metric",
        applies=lambda a: a.correction is not None and not a.correction.bypass_mode,
    ),
    # docs/definitions.md#policy-versions: only in the report of an asynchronous run (its record names the mode)
    Identity(
        "policy_versions", "8.9", RUN, "policy_version_min ≤ policy_version_max ≤ trainer_version", EXACT,
        async_checks.policy_versions, counts="response", applies=lambda a: a.asynchronous,
    ),
    Identity(
        "staleness", "8.9", RUN, _staleness_title, EXACT, async_checks.staleness,
        counts="response", applies=lambda a: a.asynchronous,
    ),
    Identity(
        "async_logged", "8.9", RUN, "verl's logged fully_async/… counts = the same counts over the rows", async_checks.COUNT,
        async_checks.logged_counts, counts="metric", applies=lambda a: (a.mode or {}).get("name") == async_checks.FULLY_ASYNC,
    ),
    Identity(
        "update_rows", "8.6", UPDATE, "each valid token trained once per epoch; rows join the token table; count as recorded",
        EXACT, update_checks.update_rows,
    ),
    Identity("ratio", "8.6", UPDATE, "ratio = exp(log_prob − old_log_prob) = verl's unclipped term / −A", update_checks.RATIO, update_checks.ratio),
    Identity("ratio_first", "8.6", UPDATE, "ratio = 1 in epoch 0, mini-batch 0", update_checks.RATIO_FIRST, update_checks.ratio_first),
    Identity("pg_loss", "8.6", UPDATE, "pg_loss = vanilla PPO term with dual clip", update_checks.PG_TERM, update_checks.pg_loss),
    Identity(
        "bypass_loss", "8.8", UPDATE, "pg_loss = the loss bypass mode's loss_type asks for (REINFORCE: −A·w·log π_θ)",
        update_checks.PG_TERM, update_checks.bypass_loss, applies=lambda a: a.correction is not None and a.correction.bypass_mode,
    ),
    Identity("clip", "8.6", UPDATE, "clip code agrees with verl's loss term", update_checks.PG_TERM, update_checks.clip),
    Identity("vf_loss", "8.6", UPDATE, "vf_loss = max((v̂−R)², (clip(v̂)−R)²)", update_checks.VF_TERM, update_checks.vf_loss),
    Identity("update_metrics", "8.6", UPDATE, "aggregated terms = verl's logged update metrics", update_checks.AGGREGATE, update_checks.update_metrics, counts="metric"),
)  # fmt: skip

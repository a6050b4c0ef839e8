"""Another ``algorithm.rollout_correction`` for ``verl-ext replay`` (docs/inspecting.md#replaying-a-step).

verl's decoupled rollout correction is a function of the step's old and rollout log-probs over the
policy's own tokens (its response mask before any rejection), and the trace holds all three: the
``old_log_prob`` and ``rollout_log_prob`` columns and ``mask ∨ rejected``. The what-if recomputes the
importance weights and the rejection under the other setting with :mod:`verl_ext.rollout_correction`
(verl's formulas), gives the step's token table with the new ``mask`` (what the advantage and the
update then use), ``rejected`` and ``rollout_is_weight``, and says what changed. The advantage is
re-estimated by the caller when the mask changed.

Bypass mode is left out both ways: there verl computes the weights and the rejection inside the loss,
against the policy being trained, and the recorded old log-probs are the rollout's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from verl_ext.errors import ReplayError

PREFIX = "rollout_correction"
#: keys the what-if refuses: they switch to or shape bypass mode
BYPASS_KEYS = ("bypass_mode", "loss_type")


def correction_keys(algorithm_overrides) -> list[str]:
    """The ``algorithm`` override keys that set the rollout correction (``rollout_correction`` or under it)."""
    return [key for key in algorithm_overrides if key == PREFIX or key.startswith(f"{PREFIX}.")]


@dataclass(frozen=True)
class Replayed:
    """The rollout correction a replay uses: ``given`` False when no override sets it (the run's);
    ``correction`` (a :class:`verl_ext.rollout_correction.Correction`, None: none) where one does."""

    given: bool
    correction: Any = None

    def settings(self) -> dict | None:
        return None if self.correction is None else self.correction.settings()


def replayed_correction(trace, algorithm_overrides) -> Replayed:
    """The correction the overrides ask for, read as verl reads ``algorithm.rollout_correction`` from the
    run's recorded config with them applied; ReplayError (one line) for a value verl refuses, bypass mode,
    or a trace that cannot say what the correction would have seen."""
    from omegaconf import OmegaConf

    from verl_ext.errors import TraceError
    from verl_ext.rollout_correction import Correction, RolloutCorrectionError
    from verl_ext.steps.recorded import recorded_correction

    keys = correction_keys(algorithm_overrides)
    if not keys:
        return Replayed(False)
    given = ", ".join(f"algorithm.{key}" for key in keys)
    if trace.record.config is None or trace.record.schema_version < 10:
        raise ReplayError(
            f"{given}: the trace is format {trace.record.schema_version}; another rollout correction needs the run's config and "
            "the tokens verl's rejection took out (format 10: the rejected column), which it does not record"
        )
    try:
        recorded = recorded_correction(trace.record.algorithm)
    except TraceError as error:
        raise ReplayError(str(error)) from None
    if recorded is not None and recorded.bypass_mode:
        raise ReplayError(
            f"{given}: the run is in bypass mode, where verl computes the weights and the rejection inside the loss against the "
            "policy being trained; the replay recomputes them from the recorded old and rollout log-probs (decoupled mode) only"
        )
    for key in keys:
        if key.rpartition(".")[2] in BYPASS_KEYS:
            raise ReplayError(
                f"override algorithm.{key}: bypass mode computes the weights and the rejection inside the loss against the policy "
                "being trained; the replay recomputes them from the recorded old and rollout log-probs (decoupled mode) only"
            )
    config = OmegaConf.create(trace.record.config)
    for key in keys:
        OmegaConf.update(config, f"algorithm.{key}", algorithm_overrides[key], merge=True, force_add=True)
    node = OmegaConf.select(config, f"algorithm.{PREFIX}")
    if node is not None and not OmegaConf.is_dict(node):
        raise ReplayError(f"override algorithm.{PREFIX}: {node!r} is not a mapping of verl's rollout-correction settings (or null)")
    try:
        correction = Correction.from_config(None if node is None else OmegaConf.to_container(node, resolve=True))
    except RolloutCorrectionError as error:
        raise ReplayError(str(error)) from None
    if correction is not None and correction.bypass_mode:
        raise ReplayError(f"{given}: bypass mode is not replayed (the weights and the rejection are computed inside the loss)")
    return Replayed(True, correction)


@dataclass
class CorrectionChange:
    """What another rollout correction changed on a step, over the policy's own tokens."""

    recorded: dict | None  # the run's correction (its settings), None: none
    replayed: dict | None
    tokens: int  # the policy's own tokens (mask ∨ rejected)
    rejected: tuple[int, int]  # rejected tokens, recorded and replayed
    newly_rejected: list[tuple[int, int]] = field(default_factory=list)  # (sample, token_index)
    newly_kept: list[tuple[int, int]] = field(default_factory=list)
    #: own tokens still trained whose weight differs (bit for bit; no weight = 1), and the largest |Δw|
    weights_changed: int = 0
    max_weight_change: float = 0.0
    #: the mean weight over the trained tokens, recorded and replayed (1 without weights)
    mean_weight: tuple[float, float] = (1.0, 1.0)

    @property
    def mask_changed(self) -> bool:
        return bool(self.newly_rejected or self.newly_kept)

    def as_dict(self) -> dict[str, Any]:
        return {
            "recorded": self.recorded, "replayed": self.replayed, "tokens": self.tokens, "rejected": list(self.rejected),
            "newly_rejected": [list(key) for key in self.newly_rejected], "newly_kept": [list(key) for key in self.newly_kept],
            "weights_changed": self.weights_changed, "max_weight_change": self.max_weight_change, "mean_weight": list(self.mean_weight),
        }  # fmt: skip

    def line(self) -> str:
        """The report's line."""
        text = (f"  rollout correction, recomputed from the recorded old and rollout log-probs over the policy's {self.tokens} tokens: "
                f"rejected {self.rejected[0]} → {self.rejected[1]} ({len(self.newly_rejected)} newly rejected, {len(self.newly_kept)} newly kept)")  # fmt: skip
        if self.weights_changed:
            text += f"; weights changed on {self.weights_changed} trained tokens (max |Δw| {self.max_weight_change:.3g})"
        else:
            text += "; no trained token's weight changed"
        return text + f"; mean weight over the trained tokens {self.mean_weight[0]:.7g} → {self.mean_weight[1]:.7g}"


def corrected_tokens(trace, step: int, replayed: Replayed) -> tuple[pa.Table, CorrectionChange]:
    """The step's token table under ``replayed``'s correction: ``mask`` = the policy's own tokens it keeps,
    ``rejected`` = those it does not (null where neither the run nor it rejects), ``rollout_is_weight`` =
    its weights (null without them), computed as verl computes them (verl_ext.rollout_correction, from
    old_log_prob − rollout_log_prob in the dtype the trainer's batch held them in); and what changed."""
    import torch

    from verl_ext.rollout_correction import is_weights, kept
    from verl_ext.steps.layout import StepLayout, floats
    from verl_ext.steps.recorded import recorded_correction

    entry = trace.step_record(step)
    if entry.samples < entry.batch_samples:
        raise ReplayError(
            f"step {step} traced {entry.samples} of its {entry.batch_samples} samples: verl's rollout correction is over the whole "
            "batch, which the trace does not hold (trace every sample: verl_ext.trace.max_samples_per_step)"
        )
    table = trace.read_step(step)
    layout = StepLayout.of(table)
    own = layout.own
    for name in ("old_log_prob", "rollout_log_prob"):
        if table[name].filter(pa.array(own)).null_count:
            raise ReplayError(f"step {step} has no {name} on every token of the policy's: verl's rollout correction needs it "
                              "(actor_rollout_ref.rollout.calculate_log_probs for the rollout's)")  # fmt: skip
    sample, token_index = table["sample"].to_numpy(), table["token_index"].to_numpy()
    shape = (entry.batch_samples, int(token_index.max()) + 1 if len(token_index) else 0)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}

    def dense(name: str) -> torch.Tensor:
        values = np.zeros(shape, np.float32)
        values[sample, token_index] = floats(table[name].fill_null(0.0), np.float32)
        return torch.from_numpy(values).to(dtypes.get(entry.stored_dtypes.get(name), torch.float32))

    own_dense = np.zeros(shape, bool)
    own_dense[sample, token_index] = own
    log_ratio = dense("old_log_prob") - dense("rollout_log_prob")  # in verl's dtype: torch promotes as verl's does
    mask = torch.from_numpy(own_dense.astype(np.float32))
    correction = replayed.correction
    keep = np.ones(len(table), bool) if correction is None else kept(log_ratio, mask, correction).numpy()[sample, token_index]
    weights = None
    if correction is not None and correction.rollout_is is not None:
        weights = is_weights(log_ratio, mask, correction).float().numpy()[sample, token_index]
    new_mask = own & keep
    rejected_now = own & ~keep
    was_rejected = own & ~layout.mask
    recorded_weights = table["rollout_is_weight"]
    rejects = (correction is not None and bool(correction.rejection)) or table["rejected"].null_count < len(table)
    columns = {
        "mask": pa.array(new_mask, pa.bool_()),
        "rejected": pa.array(rejected_now, pa.bool_()) if rejects else pa.nulls(len(table), pa.bool_()),
        "rollout_is_weight": pa.nulls(len(table), pa.float32()) if weights is None else pa.array(weights, pa.float32()),
    }
    for name, values in columns.items():
        table = table.set_column(table.schema.get_field_index(name), table.schema.field(name), values)
    before = floats(recorded_weights, np.float32) if recorded_weights.null_count < len(recorded_weights) else np.ones(len(table), np.float32)
    after = weights if weights is not None else np.ones(len(table), np.float32)
    trained = layout.mask & new_mask
    differs = trained & (before.view(np.uint32) != after.view(np.uint32))

    def keys(where: np.ndarray) -> list[tuple[int, int]]:
        return [(int(s), int(t)) for s, t in zip(sample[where], token_index[where])]

    recorded = recorded_correction(trace.record.algorithm)  # read once already by replayed_correction
    change = CorrectionChange(
        recorded=None if recorded is None else recorded.settings(), replayed=replayed.settings(), tokens=int(own.sum()),
        rejected=(int(was_rejected.sum()), int(rejected_now.sum())),
        newly_rejected=keys(layout.mask & rejected_now), newly_kept=keys(was_rejected & new_mask),
        weights_changed=int(differs.sum()),
        max_weight_change=float(np.abs(after.astype(np.float64) - before)[differs].max()) if differs.any() else 0.0,
        mean_weight=(float(before[layout.mask].astype(np.float64).mean()) if layout.mask.any() else 1.0,
                     float(after[new_mask].astype(np.float64).mean()) if new_mask.any() else 1.0),
    )  # fmt: skip
    return table, change

"""The checker on verl's rollout correction (docs/definitions.md#off-policy-tokens): steps whose importance
weights and rejected tokens come from verl's own ``compute_rollout_correction_and_rejection_mask`` on
random log-probs (a batch with holes), whose estimate ran on the mask left after the rejection (as verl's
does), written by the real TraceWriter. The checker recomputes them with verl-ext's functions, so verl's
are the independent reference; a planted weight or rejection fails at its token, through the CLI too.

Covers: verl_ext.check.correction_checks, the identities of verl_ext.check.identities they name,
verl_ext.steps.recorded (the recorded correction), the trace's ``rejected`` and ``rollout_is_weight``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.inspect.inspect_helpers import algorithm, by_definition, random_batch, rewrite_step, write_trace
from verl_ext.check.run import check_trace
from verl_ext.rollout_correction import Correction

#: (settings of algorithm.rollout_correction, as verl's config names them)
CASES = {
    "token TIS, token_k1": dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1", rollout_rs_threshold="0.97_1.03"),
    "sequence IcePop, chained": dict(
        rollout_is="sequence", rollout_is_threshold="0.5_1.5", rollout_rs="token_k2,seq_mean_k3", rollout_rs_threshold="0.0004,0.0003",
    ),
    "token, batch-normalised, seq_max_k2": dict(
        rollout_is="token", rollout_is_threshold=1.02, rollout_is_batch_normalize=True, rollout_rs="seq_max_k2", rollout_rs_threshold=0.002,
    ),
}  # fmt: skip


def corrected_batch(seed: int, settings: dict, held: torch.dtype = torch.float32):
    """random_batch's step with log-probs 2–4% apart, corrected by verl, estimated with mc on what is left;
    ``held``: the dtype the trainer keeps π_old in (its values, and verl's debug metrics of them, in it)."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    batch = random_batch(seed, kl_coef=None)
    g = torch.Generator().manual_seed(100 + seed)
    old = (-torch.rand(batch.mask.shape, generator=g) * 3).to(held)
    rollout = old.float() + torch.randn(batch.mask.shape, generator=g) * 0.03
    options = {key: settings.get(key) for key in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")}
    options["rollout_is_batch_normalize"] = bool(options["rollout_is_batch_normalize"])
    weights, kept_mask, logged = compute_rollout_correction_and_rejection_mask(old.float(), rollout, batch.mask, **options)
    logged = {**logged, **verls_debug_metrics(old, rollout, batch.mask)}
    rejected = batch.mask.bool() & ~kept_mask.bool()
    corrected = dataclasses.replace(
        batch, mask=kept_mask.float(), old_log_prob=old.float(), rollout_log_prob=rollout, rejected=rejected,
        rollout_is_weight=None if weights is None else weights.batch["rollout_is_weights"], logged=logged,
    )  # fmt: skip
    return by_definition(corrected, "mc", gamma=1.0)


def verls_debug_metrics(old, rollout, mask) -> dict:
    """What verl's calculate_debug_metrics logs of a batch (training/rollout_probs_diff_…), on the mask before its
    correction, as the trainers call it."""
    from verl import DataProto
    from verl.utils.debug.metrics import calculate_debug_metrics

    data = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask, "responses": torch.zeros_like(mask)})
    return {key: value for key, value in calculate_debug_metrics(data).items() if key.startswith("training/rollout_probs_diff_")}


def corrected_trace(tmp_path, settings: dict) -> str:
    correction = Correction.from_config(settings).settings()
    batches = {step: corrected_batch(step, settings) for step in (1, 2)}
    assert all(b.rejected.any() for b in batches.values())  # the thresholds reject something on each step
    return write_trace(tmp_path / "trace", algorithm("mc", rollout_correction=correction), batches)


@pytest.mark.parametrize("case", CASES)
def test_verls_own_weights_and_rejections_pass(tmp_path, case):
    report = check_trace(corrected_trace(tmp_path, CASES[case]))
    assert report.passed, report
    assert report["is_weights"].status == "pass" and report["rejection"].status == "pass"
    # verl's own numbers of each step, as its function returned them: the batch-normalised run's weight
    # numbers are before the normalisation, which the trace does not hold (only the others are compared)
    assert report["offpolicy_logged"].status == "pass" and report["offpolicy_logged"].checked >= 2 * (4 + 3)  # + verl's probs diff
    assert report["turns"].status == "pass" and report["roles"].status == "pass"  # a rejection is no turn boundary


def test_a_rejected_token_keeps_its_turn_and_role(tmp_path):
    """random_batch's even rows have no hole: a rejected token inside them is still turn 0, the assistant's."""
    from verl_ext.trace.reader import open_trace

    trace = open_trace(corrected_trace(tmp_path, CASES["token TIS, token_k1"]))
    table = trace.read_step(1, ["sample", "mask", "rejected", "turn", "role"]).to_pylist()
    rejected = [row for row in table if row["sample"] % 2 == 0 and row["rejected"]]
    assert rejected and all(row["turn"] == 0 and row["role"] == "assistant" and not row["mask"] for row in rejected)


def test_a_planted_weight_fails_at_its_token_and_exits_1(tmp_path, run_cli):
    import pyarrow.compute as pc

    path = corrected_trace(tmp_path, CASES["token TIS, token_k1"])

    def wrong_weight(table):
        hit = pc.and_(pc.equal(table["sample"], 3), pc.equal(table["token_index"], 2))
        column = table.schema.get_field_index("rollout_is_weight")
        return table.set_column(column, "rollout_is_weight", pc.if_else(hit, pc.multiply(table["rollout_is_weight"], 0.9), table["rollout_is_weight"]))

    rewrite_step(path, 2, table=wrong_weight)
    result = check_trace(path)["is_weights"]
    assert result.status == "fail" and result.violations == 1
    location = result.first.location
    assert (location.step, location.sample, location.token_index) == (2, 3, 2)
    code, out, _ = run_cli("check", path, "--quiet")
    assert code == 1 and "rollout_is_weight" in out and out.splitlines()[-1].startswith("FAIL")


def test_a_planted_rejection_fails(tmp_path):
    """A kept token recorded as rejected (and left out of the mask): the rejection's identity names it."""
    import pyarrow.compute as pc

    path = corrected_trace(tmp_path, CASES["token TIS, token_k1"])

    def reject_one_kept_token(table):
        far = table.filter(pc.and_(table["mask"], pc.less(pc.abs(pc.subtract(table["old_log_prob"], table["rollout_log_prob"])), 0.005)))
        sample, token = far["sample"][0].as_py(), far["token_index"][0].as_py()
        hit = pc.and_(pc.equal(table["sample"], sample), pc.equal(table["token_index"], token))
        table = table.set_column(table.schema.get_field_index("rejected"), "rejected", pc.or_(table["rejected"], hit))
        return table.set_column(table.schema.get_field_index("mask"), "mask", pc.and_(table["mask"], pc.invert(hit)))

    rewrite_step(path, 1, table=reject_one_kept_token)
    result = check_trace(path)["rejection"]
    assert result.status == "fail" and result.violations == 1 and result.first.location.step == 1
    assert "say kept" in result.first.detail


@pytest.mark.parametrize(
    ("step", "name"),
    [
        (2, "rollout_corr/rollout_rs_masked_fraction"),
        # |exp(log π_old) − exp(log π_rollout)| averaged (a difference of probabilities)
        (1, "training/rollout_probs_diff_mean"),
    ],
)
def test_a_logged_number_off_by_a_hundredth_fails(tmp_path, step, name):
    """One of verl's numbers of a step, moved by 0.01 in the recorded entry: the identity names it."""
    settings = CASES["token TIS, token_k1"]
    batches = {s: corrected_batch(s, settings) for s in (1, 2)}
    batches[step] = dataclasses.replace(batches[step], logged={**batches[step].logged, name: batches[step].logged[name] + 0.01})
    path = write_trace(tmp_path / "trace", algorithm("mc", rollout_correction=Correction.from_config(settings).settings()), batches)
    result = check_trace(path)["offpolicy_logged"]
    assert result.status == "fail" and result.violations == 1
    assert (str(result.first.location), result.first.column) == (f"step {step}", name)


def test_bypass_mode_old_log_probs_are_the_rollouts(tmp_path):
    batch = random_batch(1, kl_coef=None)
    rollout = -torch.rand(batch.mask.shape) * 3
    bypass = Correction.from_config({"bypass_mode": True, "loss_type": "ppo_clip"}).settings()
    same = by_definition(dataclasses.replace(batch, old_log_prob=rollout.clone(), rollout_log_prob=rollout), "mc", gamma=1.0)
    path = write_trace(tmp_path / "same", algorithm("mc", rollout_correction=bypass), {1: same})
    report = check_trace(path)
    assert report["bypass"].status == "pass" and report.passed
    differs = dataclasses.replace(same, old_log_prob=rollout + 1e-3 * batch.mask)
    report = check_trace(write_trace(tmp_path / "differs", algorithm("mc", rollout_correction=bypass), {1: differs}))
    assert report["bypass"].status == "fail" and report["bypass"].first.location.step == 1


def test_a_run_without_correction_has_none_of_its_identities(tmp_path):
    batch = by_definition(random_batch(1, kl_coef=None), "mc", gamma=1.0)
    report = check_trace(write_trace(tmp_path / "t", algorithm("mc"), {1: batch}))
    assert {"is_weights", "rejection", "bypass"}.isdisjoint(r.identity for r in report.identities)


def test_summary_gives_the_gap_the_weights_and_the_rejection_by_hand(tmp_path):
    """summary's off-policy columns, against numpy over the batch's own tokens (the mask before verl's
    rejection) and verl's weights; a step whose effective sample size falls below verl's warning level
    (IcePop zeroing most weights) is named in a note."""
    import numpy as np

    from verl_ext.inspect.summary import offpolicy_notes, summarize

    settings = CASES["token TIS, token_k1"]
    path = corrected_trace(tmp_path, settings)
    rows = {row["step"]: row for row in summarize(path).to_pylist()}
    for step in (1, 2):
        b = corrected_batch(step, settings)
        own = random_batch(step, kl_coef=None).mask.bool()
        gap = (b.old_log_prob - b.rollout_log_prob).abs()[own].double().numpy()
        weights = b.rollout_is_weight[own].double().numpy()
        rejected_rows = b.rejected.any(-1)[own.any(-1)]
        expected = {
            "lp_gap_p50": np.median(gap), "lp_gap_max": gap.max(), "offpolicy_kl": -(b.old_log_prob - b.rollout_log_prob)[own].double().mean().item(),
            "is_mean": weights.mean(), "rejected_tokens": b.rejected[own].double().mean().item(),
            "rejected_responses": rejected_rows.double().mean().item(),
        }  # fmt: skip
        assert {key: rows[step][key] for key in expected} == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert offpolicy_notes(summarize(path)) == []
    narrow = {"rollout_is": "token", "rollout_is_threshold": "0.999_1.001"}
    low = summarize(write_trace(tmp_path / "narrow", algorithm("mc", rollout_correction=Correction.from_config(narrow).settings()),
                                {1: corrected_batch(1, narrow)}))  # fmt: skip
    mean, ess = low["is_mean"][0].as_py(), low["is_ess"][0].as_py()
    assert mean < 0.5 and ess < 0.3  # most weights zeroed: their mean and the effective sample size fall
    assert offpolicy_notes(low) == [
        f"step 1: mean IS weight outside [0.5, 2] ({mean:.3g}); effective sample size < 0.3 ({ess:.3g}): past verl's warning level "
        "(its docs/algo/rollout_corr.md)"
    ]


def test_a_rollout_that_sampled_with_top_p_is_noted_as_biasing_the_ratio(tmp_path):
    settings = CASES["token TIS, token_k1"]
    correction = Correction.from_config(settings).settings()
    batches = {1: corrected_batch(1, settings)}
    rollout = {"name": "vllm", "version": None, "dtype": None, "top_p": 0.8, "top_k": -1}
    report = check_trace(write_trace(tmp_path / "t", algorithm("mc", rollout_correction=correction), batches, run={"rollout": rollout}))
    assert report.passed and any("top_p 0.8" in note and "biases the ratio" in note for note in report["is_weights"].notes)
    whole = check_trace(write_trace(tmp_path / "u", algorithm("mc", rollout_correction=correction), batches, run={"rollout": {**rollout, "top_p": 1.0}}))
    assert not any("biases" in note for note in whole["is_weights"].notes)


def test_verls_probs_diff_over_log_probs_held_in_bf16_passes_within_their_rounding(tmp_path):
    """V1 keeps π_old in bf16, so verl's calculate_debug_metrics takes exp(old) in bf16 (the suite's V1 run logged
    a largest |Δp| 2.3e-4 above float32's): with the step's stored_dtypes saying so, verl's own numbers of the bf16
    log-probs pass; without it, the same numbers fail (float32's error alone)."""
    settings = CASES["token TIS, token_k1"]
    batches = {step: corrected_batch(step, settings, held=torch.bfloat16) for step in (1, 2)}
    path = write_trace(tmp_path / "trace", algorithm("mc", rollout_correction=Correction.from_config(settings).settings()), batches)
    result = check_trace(path)["offpolicy_logged"]
    assert result.status == "fail" and result.first.column.startswith("training/rollout_probs_diff_"), result
    for step in (1, 2):
        rewrite_step(path, step, entry=lambda e: {**e, "stored_dtypes": {"old_log_prob": "bf16"}})
    result = check_trace(path)["offpolicy_logged"]
    assert result.status == "pass" and result.checked >= 2 * (4 + 3), result

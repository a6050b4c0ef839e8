"""algorithm.truncation at verl's advantage step, in-process: verl's own compute_advantage through the plugin's
seam, inside the plugin's real fit() wrapper of each trainer (the stand-ins of test_nonfinite_seam.py), for
verl's gae, a verl-ext estimator and verl's grpo, against tests/support/reference.py's direct sums with V_L written
into the sum; terminal is bit-for-bit the run without the option; the driver's one-line errors."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import tests.support.reference as ref
from tests.integration.conftest import requires_verl
from tests.integration.test_nonfinite_seam import STEP
from verl_ext.integration import patches

EOS = 2
ROWS, LENGTH = 6, 12
GAMMA, LAM = 0.95, 0.9
LENGTHS = (12, 8, 12, 10, 12, 12)
CUT = (True, False, True, False, False, True)  # row 4 reaches the limit on EOS
SCORES = (1.0, 0.0, 0.4, 1.0, 0.2, 0.7)


def make_batch():
    """verl's legacy batch at compute_advantage (uid groups of two), with the response ids and V(s_L)."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor(LENGTHS)
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    mask[:, 3:5] = 0
    scores = torch.zeros(ROWS, LENGTH)
    scores[torch.arange(ROWS), lengths - 1] = torch.tensor(SCORES)
    responses = torch.randint(3, 100, (ROWS, LENGTH), generator=g) * mask
    responses[4, LENGTH - 1] = EOS
    responses[1, 2] = EOS  # an EOS inside a row that ended before the limit changes nothing
    return {
        "responses": responses,
        "response_mask": mask,
        "token_level_scores": scores,
        "token_level_rewards": scores.clone(),
        "values": torch.randn(ROWS, LENGTH, generator=g),
        "values_after_last": torch.randn(ROWS, generator=g),
    }


def data_proto(tensors):
    from verl import DataProto

    uid = np.array([f"u{i // 2}" for i in range(ROWS)], dtype=object)
    return DataProto.from_dict(tensors=dict(tensors), non_tensors={"uid": uid})


def config_of(compose, estimator, truncation, *overrides):
    options = [f"algorithm.adv_estimator={estimator}", f"algorithm.gamma={GAMMA}", f"algorithm.lam={LAM}"]
    options += [f"data.max_response_length={LENGTH}", "algorithm.n_step=3", *overrides]
    return compose(*options, *([f"algorithm.truncation={truncation}"] if truncation else []))


def legacy_run(compose, estimator, truncation, tensors=None, *overrides, corrected=False):
    """One legacy advantage step; returns (the batch after, what the step estimated: step.Estimated).
    ``corrected``: verl's rollout correction runs before it, as the trainer runs it."""
    from verl.trainer.ppo import ray_trainer

    from verl_ext.integration import step

    config = config_of(compose, estimator, truncation, *overrides)
    tensors = make_batch() if tensors is None else tensors
    trainer = SimpleNamespace(config=config, global_steps=STEP, batch=data_proto(tensors), tokenizer=SimpleNamespace(eos_token_id=EOS))
    seen = {}
    advantage = step.advantage

    def legacy_fit(self):
        algorithm = self.config.algorithm
        if corrected:
            from verl.trainer.ppo import rollout_corr_helper

            self.batch, _ = rollout_corr_helper.compute_rollout_correction_and_add_to_batch(self.batch, algorithm.rollout_correction)
        self.batch = ray_trainer.compute_advantage(
            self.batch, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma, lam=algorithm.lam,
            num_repeat=2, norm_adv_by_std_in_grpo=True, config=algorithm,
        )  # fmt: skip

    def keep(*arguments):
        seen["step"] = advantage(*arguments)
        return seen["step"]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step, "advantage", keep)
        patches.wrap_legacy_fit(legacy_fit)(trainer)
    return trainer.batch, seen["step"]


def v1_run(compose, estimator, truncation, monkeypatch, outputs_per_session=1):
    """One V1 advantage step: verl's batch there lacks the response ids and V(s_L), which the step reads
    from TransferQueue (a stand-in that answers the fields asked, nested as TransferQueue holds them)."""
    import transfer_queue
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    config = config_of(compose, estimator, truncation)
    tensors = make_batch()
    stored = {
        "responses": torch.nested.as_nested_tensor([tensors["responses"][b, :n] for b, n in enumerate(LENGTHS)], layout=torch.jagged),
        "values_after_last": tensors["values_after_last"].clone(),
    }
    asked = []

    def kv_batch_get(keys, partition_id, select_fields):
        asked.extend(select_fields)
        return {name: stored[name] for name in select_fields}

    monkeypatch.setattr(transfer_queue, "kv_batch_get", kv_batch_get, raising=False)
    at_advantage_step = {k: v for k, v in tensors.items() if k not in ("responses", "values_after_last")}
    trainer = SimpleNamespace(config=config, global_steps=STEP, batch=data_proto(at_advantage_step), tokenizer=SimpleNamespace(eos_token_id=EOS))
    if outputs_per_session == 1:
        keys = [f"u{i // 2}_{i % 2}_0" for i in range(ROWS)]
    else:  # rows 2k and 2k+1: the outputs 0 and 1 of one session
        keys = [f"u{i // 2}_0_{i % 2}" for i in range(ROWS)]
    batch_meta = SimpleNamespace(keys=keys, partition_id="train", fields=None)

    def verl_compute_advantage(self, meta, metrics):
        algorithm = self.config.algorithm
        self.batch = compute_advantage_for_multi_trajectories(
            self.batch, keys, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma, lam=algorithm.lam,
            num_repeat=2, config=algorithm,
        )  # fmt: skip
        return meta

    patches.wrap_v1_fit(lambda self: patches.wrap_v1_compute_advantage(verl_compute_advantage)(self, batch_meta, {}))(trainer)
    return trainer.batch, asked


# --------------------------------------------------------------------------- the expected values, by direct sums


def expected_gae(tensors, v_last):
    """(returns, raw advantage) of GAE(γ, λ) with V_L = v_last[b] (float64, nan off the mask)."""
    r, v, m = (tensors[k].double().numpy() for k in ("token_level_rewards", "values", "response_mask"))
    returns, raw = np.full(r.shape, np.nan), np.full(r.shape, np.nan)
    for b in range(ROWS):
        idx = ref.valid_positions(m[b])
        raw[b, idx] = ref.gae_row(r[b, idx], v[b, idx], GAMMA, LAM, float(v_last[b]))
        returns[b, idx] = raw[b, idx] + v[b, idx]
    return returns, raw


def expected_nstep_returns(tensors, v_last):
    r, v, m = (tensors[k].double().numpy() for k in ("token_level_rewards", "values", "response_mask"))
    returns = np.full(r.shape, np.nan)
    for b in range(ROWS):
        idx = ref.valid_positions(m[b])
        returns[b, idx] = ref.nstep_row(r[b, idx], v[b, idx], GAMMA, 3, float(v_last[b]))
    return returns


def expected_grpo_masked(norm_by_std=True):
    """GRPO on the rows that were not cut, by hand: (score − group mean) / (group std + 1e-6) with the
    unbiased std, a group of one its score (verl's convention: mean 0, std 1); 0 on cut rows."""
    scores = np.array(SCORES)
    groups = np.arange(ROWS) // 2
    advantage = np.zeros(ROWS)
    for b in range(ROWS):
        if CUT[b]:
            continue
        same = [c for c in range(ROWS) if groups[c] == groups[b] and not CUT[c]]
        mean, std = (scores[same].mean(), scores[same].std(ddof=1)) if len(same) > 1 else (0.0, 1.0)
        advantage[b] = (scores[b] - mean) / (std + 1e-6) if norm_by_std else scores[b] - mean
    return advantage


def assert_on_mask(actual, expected, mask):
    valid = mask.bool().numpy()
    np.testing.assert_allclose(actual.double().numpy()[valid], np.asarray(expected)[valid], rtol=1e-5, atol=1e-5)


CUT_ROWS = torch.tensor(CUT)


# --------------------------------------------------------------------------- the legacy trainer


def test_the_cut_is_the_responses_at_the_limit_that_did_not_end_on_eos(compose):
    _, step = legacy_run(compose, "gae", "mask")
    assert step.truncation.mode == "mask" and step.truncation.cut.tolist() == list(CUT)


def test_verls_gae_bootstraps_from_v_l_and_keeps_the_real_rewards(compose):
    tensors = make_batch()
    batch, step = legacy_run(compose, "gae", "bootstrap", tensors)
    returns, raw = expected_gae(tensors, torch.where(CUT_ROWS, tensors["values_after_last"], 0.0))
    mask = tensors["response_mask"]
    assert_on_mask(batch.batch["returns"], returns, mask)
    assert_on_mask(batch.batch["advantages"], ref.whiten(raw, mask), mask)
    assert torch.equal(batch.batch["token_level_rewards"], make_batch()["token_level_rewards"])
    assert torch.equal(step.truncation.bootstrap_value, tensors["values_after_last"])


def test_verls_gae_masked(compose):
    tensors = make_batch()
    batch, _ = legacy_run(compose, "gae", "mask", tensors)
    returns, raw = expected_gae(tensors, np.zeros(ROWS))
    mask = tensors["response_mask"]
    kept = (mask * ~CUT_ROWS[:, None]).numpy()
    assert_on_mask(batch.batch["returns"], returns, mask)
    assert_on_mask(batch.batch["advantages"], np.where(CUT_ROWS.numpy()[:, None], 0.0, ref.whiten(raw, kept)), mask)


@pytest.mark.parametrize("truncation", ["bootstrap", "mask"])
def test_a_verl_ext_estimator(compose, truncation):
    tensors = make_batch()
    batch, _ = legacy_run(compose, "nstep", truncation, tensors)
    v_last = torch.where(CUT_ROWS, tensors["values_after_last"], 0.0) if truncation == "bootstrap" else torch.zeros(ROWS)
    returns = expected_nstep_returns(tensors, v_last)
    raw = returns - tensors["values"].double().numpy()
    mask = tensors["response_mask"]
    kept = mask if truncation == "bootstrap" else mask * ~CUT_ROWS[:, None]
    advantages = ref.whiten(raw, kept.numpy())
    if truncation == "mask":
        advantages = np.where(CUT_ROWS.numpy()[:, None], 0.0, advantages)
    assert_on_mask(batch.batch["returns"], returns, mask)
    assert_on_mask(batch.batch["advantages"], advantages, mask)


def test_grpo_masked_leaves_cut_responses_out_of_their_group(compose):
    batch, _ = legacy_run(compose, "grpo", "mask")
    mask = batch.batch["response_mask"]
    expected = expected_grpo_masked()[:, None] * np.ones((ROWS, LENGTH))
    assert_on_mask(batch.batch["advantages"], expected, mask)
    assert_on_mask(batch.batch["returns"], expected, mask)


@pytest.mark.parametrize("estimator", ["gae", "grpo", "mc", "turn_gae"])
def test_terminal_is_bit_for_bit_the_run_without_the_option_and_computes_no_cut(compose, estimator, monkeypatch):
    from verl_ext.integration import truncation_hook

    def refuse(*args, **kwargs):
        raise AssertionError("terminal computed the cut")

    monkeypatch.setattr(truncation_hook, "cut_responses", refuse)
    tensors = make_batch()
    if estimator == "grpo":
        del tensors["values"]
    without, step = legacy_run(compose, estimator, None, tensors)
    with_option, step_with = legacy_run(compose, estimator, "terminal", tensors)
    assert step.truncation is None and step_with.truncation is None
    for key in ("advantages", "returns", "token_level_rewards"):
        assert torch.equal(without.batch[key], with_option.batch[key])


def test_bootstrap_without_v_l_in_the_batch_says_so(compose):
    tensors = make_batch()
    del tensors["values_after_last"]
    with pytest.raises(RuntimeError, match="algorithm.truncation=bootstrap needs V\\(s_L\\).*batch key values_after_last"):
        legacy_run(compose, "gae", "bootstrap", tensors)


# --------------------------------------------------------------------------- the V1 trainer


@requires_verl("0.9.0", "no V1 trainer")
def test_v1_reads_the_ids_and_v_l_from_transfer_queue(compose, monkeypatch):
    tensors = make_batch()
    batch, asked = v1_run(compose, "gae", "bootstrap", monkeypatch)
    assert set(asked) == {"responses", "values_after_last"}
    returns, raw = expected_gae(tensors, torch.where(CUT_ROWS, tensors["values_after_last"], 0.0))
    mask = tensors["response_mask"]
    assert_on_mask(batch.batch["returns"], returns, mask)
    assert_on_mask(batch.batch["advantages"], ref.whiten(raw, mask), mask)


@requires_verl("0.9.0", "no V1 trainer")
def test_v1_stores_the_masked_grpo_advantages(compose, monkeypatch):
    batch, asked = v1_run(compose, "grpo", "mask", monkeypatch)
    assert asked == ["responses"]
    expected = expected_grpo_masked()[:, None] * np.ones((ROWS, LENGTH))
    assert_on_mask(batch.batch["advantages"], expected, batch.batch["response_mask"])


@requires_verl("0.9.0", "no V1 trainer")
def test_v1_grpo_over_sessions_of_several_outputs_is_refused(compose, monkeypatch):
    with pytest.raises(RuntimeError, match="algorithm.truncation=mask: the advantage step holds 3 rows and the stored batch 6"):
        v1_run(compose, "grpo", "mask", monkeypatch, outputs_per_session=2)


# --------------------------------------------------------------------------- validation on the driver


def validate(config):
    from verl.utils.config import validate_config

    validate_config(config, use_reference_policy=False, use_critic=True)


@pytest.mark.parametrize(
    "estimator, overrides, message",
    [
        ("gae", ["algorithm.truncation=cut"], r"algorithm.truncation must be one of terminal, bootstrap, mask, got 'cut'"),
        (
            "grpo",
            ["algorithm.truncation=bootstrap"],
            r"algorithm.truncation=bootstrap .* algorithm.adv_estimator=grpo has no critic: use algorithm.truncation=mask",
        ),
        ("rloo", ["algorithm.truncation=mask"], r"algorithm.truncation=mask needs an estimator verl-ext knows .* algorithm.adv_estimator=rloo"),
        ("gae", ["algorithm.truncation=mask", "algorithm.use_pf_ppo=true"], r"algorithm.truncation=mask with algorithm.use_pf_ppo=True"),
    ],
)
def test_what_cannot_apply_is_one_line_naming_the_key(compose, estimator, overrides, message):
    import warnings

    with pytest.raises(ValueError, match=message) as error, warnings.catch_warnings():
        warnings.simplefilter("error")  # the one line, not a warning that the option is ignored before it
        validate(compose(f"algorithm.adv_estimator={estimator}", *overrides))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "estimator, truncation", [("gae", "bootstrap"), ("grpo", "mask"), ("mc", "bootstrap"), ("turn_gae", "mask"), ("rloo", "terminal")]
)
def test_what_applies_passes(compose, estimator, truncation):
    from verl_ext.integration.validation import check_config

    check_config(compose(f"algorithm.adv_estimator={estimator}", f"algorithm.truncation={truncation}"))


@requires_verl("0.9.0", "rollout correction and its touch are written for verl 0.9")
def test_a_cut_response_whose_last_tokens_verls_rejection_took_is_still_cut(compose):
    """verl's rollout correction rejects row 0's last token (token_k1: its ratio e is outside [0.5, 2]): the response
    still ran to the length limit without EOS, so it is cut (docs/definitions.md#off-policy-tokens: a rejected token is
    the policy's), bootstraps from V(s_L) after its last kept token, and the others are as without the rejection."""
    tensors = make_batch()
    tensors["old_log_probs"] = torch.full((ROWS, LENGTH), -1.0)
    tensors["rollout_log_probs"] = tensors["old_log_probs"].clone()
    tensors["rollout_log_probs"][0, LENGTH - 1] = -2.0  # ℓ = 1 at row 0's last token only
    after, estimated = legacy_run(
        compose, "gae", "bootstrap", tensors, "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0'", corrected=True,
    )  # fmt: skip
    kept = after.batch["response_mask"].numpy()
    assert kept[0, LENGTH - 1] == 0 and kept.sum() == make_batch()["response_mask"].sum() - 1  # verl rejected that token alone
    assert estimated.truncation.cut.tolist() == list(CUT)
    batch = after.batch
    v_last = np.where(CUT, batch["values_after_last"].numpy(), 0.0)
    want = ref.gae_advantages(batch["token_level_rewards"].numpy(), batch["values"].numpy(), kept, GAMMA, LAM, v_last)
    returns = want + batch["values"].numpy()
    np.testing.assert_allclose(batch["returns"].numpy()[kept != 0], returns[kept != 0], rtol=1e-5, atol=1e-5)

"""The live metrics (verl_ext.metrics) through verl's own compute_advantage, in-process, trace off.

As in test_nonfinite_seam.py, the plugin's real fit() wrapper of each trainer runs around a stand-in
for verl's fit that makes the calls verl's trainer makes in a step: the legacy trainer's
compute_advantage (ray_trainer.py:1667) and compute_data_metrics (ray_trainer.py:1772), the V1
trainer's _compute_advantage (trainer_base.py:600). What the step's metrics receive is held to
tests/support/reference.py's direct sums on the batch verl-ext's estimator (or verl's) left."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import tests.support.reference as ref
from tests.integration.test_nonfinite_seam import ROWS, STEP, TRAINERS, data_proto, make_step
from verl_ext.integration import patches

GAMMA = 0.97


def step_metrics_of(compose, trainer_kind, estimator, *overrides, dtypes=None):
    """(the step's metrics as verl would log them, the batch after compute_advantage); ``dtypes``:
    batch keys handed over in another dtype (a bf16 run's values)."""
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    config = compose(f"algorithm.adv_estimator={estimator}", f"algorithm.gamma={GAMMA}", "algorithm.lam=0.9", *overrides)
    tensors = make_step()
    tensors |= {key: tensors[key].to(dtype) for key, dtype in (dtypes or {}).items()}
    if estimator == "grpo":
        del tensors["values"]
    trainer = SimpleNamespace(config=config, global_steps=STEP, batch=data_proto(tensors))
    algorithm = config.algorithm
    metrics = {}

    def legacy_fit(self):
        self.batch = ray_trainer.compute_advantage(
            self.batch, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma, lam=algorithm.lam,
            num_repeat=2, config=algorithm,
        )  # fmt: skip
        # verl's compute_data_metrics needs a full batch; its installed replacement wraps any original
        assert hasattr(ray_trainer.compute_data_metrics, "__verl_ext_original__")
        metrics.update(patches.wrap_compute_data_metrics(lambda batch, use_critic: {"critic/score/mean": 0.5})(batch=self.batch, use_critic=True))

    def v1_compute_advantage(self, batch_meta, step_metrics):
        self.batch = compute_advantage_for_multi_trajectories(
            self.batch, [f"u{i // 2}_{i % 2}_0" for i in range(ROWS)], adv_estimator=algorithm.adv_estimator,
            gamma=algorithm.gamma, lam=algorithm.lam, num_repeat=2, config=algorithm,
        )  # fmt: skip
        return batch_meta

    if trainer_kind == "legacy":
        patches.wrap_legacy_fit(legacy_fit)(trainer)
    else:
        patches.wrap_v1_fit(lambda self: patches.wrap_v1_compute_advantage(v1_compute_advantage)(self, None, metrics))(trainer)
    return metrics, trainer.batch


def expected(batch, raw):
    b = {key: value.double().numpy() for key, value in batch.batch.items()}
    want = ref.live_metrics(
        b["token_level_rewards"], b.get("values"), raw, b["advantages"], b["token_level_scores"], b["response_mask"],
        batch.non_tensor_batch["uid"], GAMMA,
    )  # fmt: skip
    # make_step's batch has the rollout's log-probs and no rollout correction: the gap over the valid tokens
    want |= ref.offpolicy_gap(b["old_log_probs"], b["rollout_log_probs"], b["response_mask"])
    return {f"verl_ext/{key}": value for key, value in want.items()}


def assert_metrics(metrics, want):
    got = {key: value for key, value in metrics.items() if key.startswith("verl_ext/")}
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key  # the batch is float32


@pytest.mark.parametrize("trainer_kind", TRAINERS)
@pytest.mark.parametrize("estimator", ["mc", "gae_ext", "gae", "grpo"])
def test_every_step_gets_the_metrics(compose, trainer_kind, estimator):
    overrides = ["algorithm.lam_actor=0.5"] if estimator == "gae_ext" else []
    metrics, batch = step_metrics_of(compose, trainer_kind, estimator, *overrides)
    mask = batch.batch["response_mask"].numpy()
    values = batch.batch["values"].numpy() if estimator != "grpo" else None
    rewards = batch.batch["token_level_rewards"].numpy()
    if estimator == "mc":
        raw = ref.mc_returns(rewards, mask, GAMMA) - values
    elif estimator == "gae_ext":  # the raw advantage is GAE(λ_actor), not returns − values
        raw = ref.gae_advantages(rewards, values, mask, GAMMA, 0.5)
    elif estimator == "gae":  # verl's: returns − values
        raw = ref.gae_advantages(rewards, values, mask, GAMMA, 0.9)
    else:  # grpo: the advantage itself
        raw = batch.batch["advantages"].numpy()
    want = expected(batch, np.nan_to_num(raw))
    # make_step's responses have a hole at positions 3-4: two turns each, so 2 turn shares (and turn0,
    # turn1, after_hole EVs, which its 6 rows leave, with last and the deciles, under the 8 tokens an EV
    # needs: of the critic's 15 EVs only all's; every bucket's is checked in tests/test_step_metrics.py)
    assert len(want) == (18 + 5 - 14 if estimator != "grpo" else 6 + 2) + 4  # + the 4 off-policy numbers
    assert_metrics(metrics, want)
    assert trainer_kind == "v1" or metrics["critic/score/mean"] == 0.5  # verl's own metrics kept


@pytest.mark.parametrize("trainer_kind", TRAINERS)
def test_bf16_columns_are_read_exactly(compose, trainer_kind):
    """A bf16 run hands over bf16 values (and a user's estimator or reward may leave any float
    column bf16): the metrics are those of the bf16 numbers themselves, read exactly."""
    bf16 = dict.fromkeys(("values", "token_level_scores", "token_level_rewards"), torch.bfloat16)
    metrics, batch = step_metrics_of(compose, trainer_kind, "mc", dtypes=bf16)
    assert batch.batch["values"].dtype == torch.bfloat16  # the run's own values, not a float32 copy
    mask = batch.batch["response_mask"].numpy()
    values = batch.batch["values"].double().numpy()  # bf16 -> float64 is exact
    raw = ref.mc_returns(batch.batch["token_level_rewards"].double().numpy(), mask, GAMMA) - values
    assert_metrics(metrics, expected(batch, np.nan_to_num(raw)))


@pytest.mark.parametrize("trainer_kind", TRAINERS)
def test_off_computes_nothing(compose, trainer_kind, monkeypatch):
    from verl_ext import step_metrics

    monkeypatch.setattr(step_metrics, "step_metrics", lambda *a, **k: pytest.fail("computed although off"))
    metrics, _ = step_metrics_of(compose, trainer_kind, "mc", "verl_ext.metrics=false")
    assert not [key for key in metrics if key.startswith("verl_ext/")]


def test_bad_value_stops_before_training(compose):
    from verl.utils.config import validate_config

    with pytest.raises(ValueError, match=r"verl_ext.metrics must be true or false, got 'often'"):
        validate_config(compose("algorithm.adv_estimator=mc", "verl_ext.metrics=often"), use_reference_policy=False, use_critic=True)


@pytest.mark.parametrize("mode", ["one_step_off", "sync"])
def test_an_asynchronous_steps_staleness_is_a_live_metric(compose, mode):
    """verl's one-step-off trainer (known by its class's module and name, as a subclass Ray makes keeps them) at
    step 7 trains from the weights it synced as 7 (docs/definitions.md#policy-versions); its agent loop tagged the
    responses with the versions of their first and last tokens. By hand: staleness 1, 1, 0, 0, 1 (a response
    without versions left out), one spanning 6–7. A synchronous trainer's step has no such metric."""
    from verl.trainer.ppo import ray_trainer

    config = compose("algorithm.adv_estimator=mc", f"algorithm.gamma={GAMMA}")
    batch = data_proto(make_step())
    batch.non_tensor_batch["min_global_steps"] = np.array([6, 6, 7, 7, None, 6], dtype=object)
    batch.non_tensor_batch["max_global_steps"] = np.array([6, 7, 7, 7, None, 6], dtype=object)
    trainer_class = type("OneStepOffRayTrainer" if mode == "one_step_off" else "RayPPOTrainer", (), {})
    if mode == "one_step_off":
        trainer_class.__module__ = "verl.experimental.one_step_off_policy.ray_trainer"
    trainer = trainer_class()
    trainer.config, trainer.global_steps, trainer.batch = config, STEP, batch
    metrics = {}

    def fit(self):
        self.batch = ray_trainer.compute_advantage(self.batch, adv_estimator="mc", gamma=GAMMA, lam=1.0, num_repeat=2, config=config.algorithm)
        metrics.update(patches.wrap_compute_data_metrics(lambda batch, use_critic: {})(batch=self.batch, use_critic=True))

    patches.wrap_legacy_fit(fit)(trainer)
    got = {key: value for key, value in metrics.items() if "/staleness" in key or key.endswith(("stale_share", "spanned_share"))}
    if mode == "sync":
        assert got == {}
        return
    assert got == pytest.approx({
        "verl_ext/offpolicy/staleness_mean": 3 / 5, "verl_ext/offpolicy/staleness_max": 1.0,
        "verl_ext/offpolicy/stale_share": 3 / 5, "verl_ext/offpolicy/spanned_share": 1 / 5,
    })  # fmt: skip

"""verl_ext.nonfinite through verl's own compute_advantage, in-process, trace off (with the trace on,
the step kept when it raises: tests/integration/test_trace_hook.py).

Each test runs the plugin's real ``fit()`` wrapper of the legacy or the V1 trainer around a stand-in
for verl's ``fit`` that makes the call verl's trainer makes at that point of a step
(ray_trainer.py:1667 ``compute_advantage(batch, ...)``; V1: ``_compute_advantage`` →
``compute_advantage_for_multi_trajectories``, trainer_base.py:1775), so the mode comes from the run's
config, the step from ``trainer.global_steps``, and the check runs where a real step runs it.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.integration.conftest import requires_verl
from verl_ext.integration import patches
from verl_ext.nonfinite import NonFiniteError

STEP = 7
ROWS, LENGTH = 6, 12


def make_step(seed=0):
    """A finite batch as verl has it at compute_advantage: lengths 6-12, a hole at tokens 3-4."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([12, 8, 6, 10, 7, 12])
    mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
    mask[:, 3:5] = 0
    scores = torch.zeros(ROWS, LENGTH)
    scores[torch.arange(ROWS), lengths - 1] = torch.tensor([1.0, 0.0, 0.4, 1.0, 0.2, 0.0])
    tensors = {
        "response_mask": mask,
        "token_level_scores": scores,
        "token_level_rewards": scores,  # verl: `batch["token_level_rewards"] = batch["token_level_scores"]`
        "values": torch.randn(ROWS, LENGTH, generator=g),
        "old_log_probs": -torch.rand(ROWS, LENGTH, generator=g),
        "ref_log_prob": -torch.rand(ROWS, LENGTH, generator=g),
        "rollout_log_probs": -torch.rand(ROWS, LENGTH, generator=g),
    }
    return tensors


def data_proto(tensors):
    from verl import DataProto

    uid = np.array([f"u{i // 2}" for i in range(ROWS)], dtype=object)
    return DataProto.from_dict(tensors=dict(tensors), non_tensors={"uid": uid})


def legacy_step(trainer):
    """What RayPPOTrainer.fit does at its advantage step (ray_trainer.py:1667)."""
    from verl.trainer.ppo import ray_trainer

    algorithm = trainer.config.algorithm
    return ray_trainer.compute_advantage(
        trainer.batch, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma, lam=algorithm.lam,
        num_repeat=trainer.config.actor_rollout_ref.rollout.n, norm_adv_by_std_in_grpo=True, config=algorithm,
    )  # fmt: skip


def v1_step(trainer):
    """What PPOTrainer.fit does: its (patched) _compute_advantage, whose verl body calls
    compute_advantage_for_multi_trajectories (trainer_base.py:1775) after reading TransferQueue."""
    from verl.trainer.ppo.v1.utils import compute_advantage_for_multi_trajectories

    def verl_compute_advantage(self, batch_meta, metrics):
        algorithm = self.config.algorithm
        self.batch = compute_advantage_for_multi_trajectories(
            self.batch, [f"u{i // 2}_{i % 2}_0" for i in range(ROWS)], adv_estimator=algorithm.adv_estimator,
            gamma=algorithm.gamma, lam=algorithm.lam, num_repeat=1, config=algorithm,
        )  # fmt: skip
        self.after_verl = True  # verl's own code after compute_advantage ran (TransferQueue writes)
        return batch_meta

    patches.wrap_v1_compute_advantage(verl_compute_advantage)(trainer, None, {})
    return trainer.batch


STEPS = {"legacy": (patches.wrap_legacy_fit, legacy_step), "v1": (patches.wrap_v1_fit, v1_step)}
TRAINERS = ["legacy", pytest.param("v1", marks=requires_verl("0.9.0", "no V1 trainer"))]


def run_step(compose, trainer_kind, tensors, estimator="mc", *overrides, seen=None):
    """One advantage step in the plugin's fit() of ``trainer_kind``; returns (batch after, trainer)
    (the trainer also in ``seen["trainer"]``, for a step that raises)."""
    wrap_fit, step = STEPS[trainer_kind]
    config = compose(f"algorithm.adv_estimator={estimator}", "algorithm.gamma=0.97", "algorithm.lam=0.9", *overrides)
    trainer = SimpleNamespace(config=config, global_steps=STEP, batch=data_proto(tensors), after_verl=False)
    if seen is not None:
        seen["trainer"] = trainer
    result = {}
    wrap_fit(lambda self: result.setdefault("batch", step(self)))(trainer)
    return result["batch"], trainer


def first_valid_from(mask, row, token):
    return int(next(t for t in range(token, LENGTH) if mask[row, t]))


def expected_value_line(mask, row, token, also=""):
    valid = int(mask.sum())
    return (
        f"verl-ext: step {STEP}: advantages not finite on {valid} of {valid} valid tokens, first nan at sample 0 "
        f"(uid u0), token 0; first non-finite upstream: values, nan at sample {row} (uid u{row // 2}), token {token} "
        f"(1 valid token){also}"
    )


@pytest.mark.parametrize("trainer_kind", TRAINERS)
def test_warn_names_the_nan_value_in_one_line_and_training_goes_on(compose, capfd, trainer_kind):
    tensors = make_step()
    token = first_valid_from(tensors["response_mask"], 3, 5)
    tensors["values"][3, token] = float("nan")
    batch, trainer = run_step(compose, trainer_kind, tensors)
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("verl-ext")] == [
        expected_value_line(tensors["response_mask"], 3, token)
    ]
    assert batch.batch["advantages"].isnan().all()  # mc + whitening: every advantage, as verl would train on
    assert trainer_kind == "legacy" or trainer.after_verl


@pytest.mark.parametrize("trainer_kind", TRAINERS)
def test_raise_stops_the_step_with_that_line(compose, capfd, trainer_kind):
    tensors = make_step()
    token = first_valid_from(tensors["response_mask"], 3, 5)
    tensors["values"][3, token] = float("nan")
    seen = {}
    with pytest.raises(NonFiniteError) as raised:
        run_step(compose, trainer_kind, tensors, "mc", "verl_ext.nonfinite=raise", seen=seen)
    assert str(raised.value) == expected_value_line(tensors["response_mask"], 3, token)
    assert "verl-ext: step" not in capfd.readouterr().err  # said once, by the error
    # V1: raised at the end of _compute_advantage, after verl stored the step (and the trace read it back)
    assert seen["trainer"].after_verl == (trainer_kind == "v1")


@pytest.mark.parametrize("trainer_kind", TRAINERS)
@pytest.mark.parametrize(
    "quantity, value, row, token",
    [
        ("old_log_probs", float("-inf"), 2, 0),
        ("ref_log_prob", float("nan"), 5, 11),
        ("rollout_log_probs", float("inf"), 0, 7),
    ],
)
def test_each_log_prob_is_checked_with_the_trace_off(compose, capfd, trainer_kind, quantity, value, row, token):
    tensors = make_step()
    tensors[quantity][row, token] = value
    tensors[quantity][1, 10] = float("nan")  # a masked position (row 1 has 8 tokens): not reported
    run_step(compose, trainer_kind, tensors)
    shown = "nan" if value != value else ("inf" if value > 0 else "-inf")
    valid = int(tensors["response_mask"].sum())
    assert capfd.readouterr().err.splitlines()[-1] == (
        f"verl-ext: step {STEP}: {quantity} not finite on 1 of {valid} valid tokens, first {shown} at sample {row} "
        f"(uid u{row // 2}), token {token}; nothing upstream of it is non-finite"
    )


@pytest.mark.parametrize("trainer_kind", TRAINERS)
def test_verls_gae_a_nan_value_and_the_returns_it_spoiled(compose, capfd, trainer_kind):
    tensors = make_step()
    tensors["values"][4, 6] = float("nan")
    run_step(compose, trainer_kind, tensors, "gae")
    spoiled = int(tensors["response_mask"][4, :7].sum())  # verl's GAE: returns = A + V at tokens ≤ 6 of row 4
    also = f"; also not finite: returns ({spoiled} valid tokens, first nan at sample 4 (uid u2), token 0)"
    assert capfd.readouterr().err.splitlines()[-1] == expected_value_line(tensors["response_mask"], 4, 6, also)


@pytest.mark.parametrize("trainer_kind", TRAINERS)
def test_verls_grpo_a_nan_score_through_the_rewards(compose, capfd, trainer_kind):
    tensors = make_step()
    tensors["token_level_scores"][1, 7] = float("nan")  # the score on row 1's last token (also the reward)
    run_step(compose, trainer_kind, tensors, "grpo")
    line = capfd.readouterr().err.splitlines()[-1]
    group = int(tensors["response_mask"][:2].sum())  # GRPO: rows 0 and 1 share uid u0
    assert line.startswith(f"verl-ext: step {STEP}: advantages not finite on {group} of ")
    assert line.endswith(
        "; first non-finite upstream: token_level_scores (via token_level_rewards), nan at sample 1 (uid u0), token 7 "
        f"(1 valid token); also not finite: returns ({group} valid tokens, first nan at sample 0 (uid u0), token 0)"
    )  # verl's GRPO: returns = advantages


@pytest.mark.parametrize("trainer_kind", TRAINERS)
def test_a_finite_step_says_nothing_and_off_never_looks(compose, capfd, trainer_kind):
    run_step(compose, trainer_kind, make_step())
    tensors = make_step()
    tensors["values"][0, 0] = float("nan")
    run_step(compose, trainer_kind, tensors, "mc", "verl_ext.nonfinite=off")
    assert "verl-ext" not in capfd.readouterr().err


def test_outside_fit_the_default_is_warn_and_the_step_comes_from_meta_info(compose, capfd):
    from verl.trainer.ppo import ray_trainer

    tensors = make_step()
    tensors["values"][0, 0] = float("nan")
    data = data_proto(tensors)
    data.meta_info["global_steps"] = 3
    config = compose("algorithm.adv_estimator=td0")
    ray_trainer.compute_advantage(data, adv_estimator="td0", config=config.algorithm)
    assert re.match(r"verl-ext: step 3: advantages not finite .*first non-finite upstream: values, nan at sample 0 \(uid u0\), token 0", capfd.readouterr().err.splitlines()[-1])


def test_bad_mode_stops_before_training(compose):
    from verl.utils.config import validate_config

    with pytest.raises(ValueError, match=r"verl_ext.nonfinite must be one of warn, raise, off, got 'maybe'"):
        validate_config(compose("algorithm.adv_estimator=mc", "verl_ext.nonfinite=maybe"), use_reference_policy=False, use_critic=True)

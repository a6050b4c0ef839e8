"""verl_ext.rollout_correction against verl 0.9.1's own functions (imported here, in the tests, only),
against hand calculation, and its rounding-error bounds against verl's float32 computation."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from verl_ext import rollout_correction as rc
from verl_ext.rollout_correction import Correction, RejectionOption

KEY = "algorithm.rollout_correction"


def batch(seed: int, rows: int = 16, length: int = 48, scale: float = 0.3):
    """float32 log-probs as the trainer holds them, and an int64 mask (as verl's) with trailing
    padding, interior holes, one row without a valid token and one full row."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, length, generator=g) * 3
    rollout = old + torch.randn(rows, length, generator=g) * scale
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]) & (torch.rand(rows, length, generator=g) > 0.2)
    mask[0] = False
    mask[1] = True
    return old, rollout, mask.long()


def verl_step(old, rollout, mask, config):
    """verl's own entry point on a batch: (rollout_is_weights or None, response_mask after rejection, metrics)."""
    from verl.protocol import DataProto
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch

    data = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask.clone()})
    data, metrics = compute_rollout_correction_and_add_to_batch(data, config)
    weights = data.batch["rollout_is_weights"] if "rollout_is_weights" in data.batch.keys() else None
    return weights, data.batch["response_mask"], metrics


@pytest.fixture
def verl_statistics(monkeypatch):
    """Every statistic verl's rejection computes, per token, as verl passes it to compute_rs_metrics."""
    from verl.trainer.ppo import rollout_corr_helper as helper

    captured = {}
    original = helper.compute_rs_metrics

    def spy(option_name, rs_statistic, *args, **kwargs):
        captured[option_name] = rs_statistic.clone()
        return original(option_name, rs_statistic, *args, **kwargs)

    monkeypatch.setattr(helper, "compute_rs_metrics", spy)
    return captured


def same(mine: torch.Tensor, verls: torch.Tensor):
    """float64: to 1e-12 relative; float32: bit for bit."""
    assert mine.dtype == verls.dtype and mine.shape == verls.shape
    if mine.dtype == torch.float64:
        torch.testing.assert_close(mine, verls, rtol=1e-12, atol=0)
    else:
        assert torch.equal(mine, verls), (mine - verls).abs().max()


# --------------------------------------------------------------------------- against verl


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("batch_normalize", [False, True])
@pytest.mark.parametrize("threshold", [2.0, "1.5", "0.5_2.0"], ids=["tis", "tis-string", "icepop"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_is_weights_are_verls(level, threshold, batch_normalize, dtype):
    old, rollout, mask = batch(1, scale=0.3 if level == "token" else 0.25)
    old, rollout = old.to(dtype), rollout.to(dtype)
    config = {"rollout_is": level, "rollout_is_threshold": threshold, "rollout_is_batch_normalize": batch_normalize}
    weights, rejected, _ = verl_step(old, rollout, mask, config)
    correction = Correction.from_config(config)
    mine = rc.is_weights(old - rollout, mask, correction)
    same(mine, weights)
    assert torch.equal(rejected, mask) and torch.equal(rc.kept(old - rollout, mask, correction), torch.ones_like(mask, dtype=torch.bool))
    raw = rc.is_weights(old - rollout, mask, dataclasses.replace(correction, is_upper=math.inf, is_lower=None, batch_normalize=False))
    valid = mask.bool()
    # the batch exercises both sides of the bounds
    assert (raw[valid] > correction.is_upper).any() and (raw[valid] < correction.is_upper).any()
    if correction.is_lower is not None:
        assert (raw[valid] < correction.is_lower).any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", sorted(rc.OPTIONS))
def test_each_rejection_option_is_verls(name, dtype, verl_statistics):
    """Thresholds at quantiles of the statistic itself, so that both verdicts occur (and a statistic
    equal to a bound is tested as verl compares it)."""
    old, rollout, mask = batch(2)
    old, rollout = old.to(dtype), rollout.to(dtype)
    lr = old - rollout
    level, statistic, aggregate = rc.OPTIONS[name]
    probe = RejectionOption(name, level, statistic, aggregate, -1.0 if statistic == "k1" else None, 1.0)
    values = rc.rejection_statistic(lr, mask, probe)[mask.bool()].double()
    if statistic == "k1":
        spec = f"{math.exp(values.quantile(0.2).item())!r}_{math.exp(values.quantile(0.8).item())!r}"
    else:
        spec = repr(values.quantile(0.6).item())
    config = {"rollout_rs": name, "rollout_rs_threshold": spec}
    _, rejected, metrics = verl_step(old, rollout, mask, config)
    correction = Correction.from_config(config)
    assert correction.rejection[0].name == name and correction.rollout_is is None
    keep = rc.kept(lr, mask, correction)
    assert torch.equal(mask * keep, rejected)
    assert 0 < int(rejected.sum()) < int(mask.sum())
    same(rc.rejection_statistic(lr, mask, correction.rejection[0]), verl_statistics[name])
    assert rc.is_weights(lr, mask, correction).equal(mask.to(dtype))  # no IS weights: the loss weighs nothing


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    "options, spec",
    [
        ("token_k1,seq_sum_k3,seq_max_k2", "1.5"),
        ("token_k1,seq_sum_k3,seq_max_k2", "0.8_1.25,3.0,0.5"),
        ("token_k1,seq_sum_k3,seq_max_k2", 1.5),
        (" seq_mean_k1 , token_k2,seq_mean_k1", "0.9_1.2, 0.05"),  # spaces; a duplicate dropped before counting
        ("seq_mean_k3,token_k3,seq_sum_k1,token_k2", "0.06,0.2,0.2_5,0.1"),
    ],
)
def test_chained_options_are_verls(options, spec, dtype):
    old, rollout, mask = batch(3)
    old, rollout = old.to(dtype), rollout.to(dtype)
    config = {"rollout_rs": options, "rollout_rs_threshold": spec}
    _, rejected, _ = verl_step(old, rollout, mask, config)
    correction = Correction.from_config(config)
    assert torch.equal(mask * rc.kept(old - rollout, mask, correction), rejected)
    assert 0 < int(rejected.sum()) < int(mask.sum())
    names = [option.name for option in correction.rejection]
    assert names == list(dict.fromkeys(name.strip() for name in options.split(",")))
    # each option alone rejects a subset of what the chain rejects, and the chain is their AND
    alone = [rc.kept(old - rollout, mask, dataclasses.replace(correction, rejection=(option,))) for option in correction.rejection]
    assert torch.equal(rc.kept(old - rollout, mask, correction), torch.stack(alone).all(dim=0))


def test_k1_thresholds_are_log_ratio_bounds():
    """k1: 'lower_upper' bounds log(lower) ≤ −lr ≤ log(upper); one number u means lower = 1/u, as verl
    reads it (str(1/u) round-trips: the same float); k2/k3 bounds are taken as given."""
    single = Correction.from_config({"rollout_rs": "seq_sum_k1,token_k2", "rollout_rs_threshold": "2.5"})
    pair = Correction.from_config({"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.4_2.5"})
    assert single.rejection[0] == RejectionOption("seq_sum_k1", "sequence", "k1", "sum", math.log(1 / 2.5), math.log(2.5))
    assert pair.rejection[0] == single.rejection[0]
    assert single.rejection[1] == RejectionOption("token_k2", "token", "k2", "token", None, 2.5)
    old, rollout, mask = batch(4)
    for config in ({"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "2.5"}, {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.4_2.5"}):
        _, rejected, _ = verl_step(old, rollout, mask, config)
        assert torch.equal(mask * rc.kept(old - rollout, mask, Correction.from_config(config)), rejected)


def test_k1_ratio_bounds_bound_the_inverse_ratio():
    """k1 = −lr = log(π_rollout/π_old): verl's 'lower_upper' for k1 keeps 1/upper ≤ π_old/π_rollout ≤ 1/lower,
    not lower ≤ π_old/π_rollout ≤ upper as its docs say ("ratio bounds"); the same only for upper = 1/lower.
    With '0.5_4.0', a token with π_old/π_rollout = 3 is rejected and one with 0.3 kept."""
    old = torch.log(torch.tensor([[0.3, 0.3, 0.3]], dtype=torch.float64))
    rollout = torch.log(torch.tensor([[0.1, 1.0, 0.5]], dtype=torch.float64))  # ratios 3, 0.3, 0.6
    mask = torch.ones(1, 3, dtype=torch.long)
    config = {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_4.0"}
    _, rejected, _ = verl_step(old, rollout, mask, config)
    assert rejected.tolist() == [[0, 1, 1]]
    assert (mask * rc.kept(old - rollout, mask, Correction.from_config(config))).tolist() == [[0, 1, 1]]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_weights_and_rejection_together_are_verls(dtype):
    old, rollout, mask = batch(5, scale=0.1)
    old, rollout = old.to(dtype), rollout.to(dtype)
    config = {
        "rollout_is": "sequence", "rollout_is_threshold": "0.5_3.0", "rollout_is_batch_normalize": True,
        "rollout_rs": "token_k2,seq_mean_k1", "rollout_rs_threshold": "0.02,0.95_1.05",
    }
    weights, rejected, _ = verl_step(old, rollout, mask, config)
    correction = Correction.from_config(config)
    # the weights come from the mask before rejection
    same(rc.is_weights(old - rollout, mask, correction), weights)
    assert torch.equal(mask * rc.kept(old - rollout, mask, correction), rejected)
    assert 0 < int(rejected.sum()) < int(mask.sum())


def test_verls_presets_read_as_verl_computes_them():
    """Every preset of verl's RolloutCorrectionConfig (a typed config with .get) reads, and computes what verl computes."""
    from verl.trainer.config.algorithm import RolloutCorrectionConfig

    presets = [name for name, value in vars(RolloutCorrectionConfig).items() if isinstance(value, classmethod)]
    assert len(presets) >= 15
    old, rollout, mask = batch(6, scale=0.05)
    for name in presets:
        config = getattr(RolloutCorrectionConfig, name)()
        correction = Correction.from_config(config)
        weights, rejected, _ = verl_step(old, rollout, mask, config)
        if correction is None:
            assert name == "disabled" and weights is None and torch.equal(rejected, mask)
            continue
        assert correction.bypass_mode == bool(config.bypass_mode), name
        if weights is None:
            assert correction.rollout_is is None, name
        else:
            same(rc.is_weights(old - rollout, mask, correction), weights)
        assert torch.equal(mask * rc.kept(old - rollout, mask, correction), rejected), name


# --------------------------------------------------------------------------- the settings


REFUSED = [
    ({"rollout_is": "tokens"}, "rollout_is"),
    ({"rollout_is": ""}, "rollout_is"),
    ({"rollout_is": "token", "rollout_is_threshold": "abc"}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": "  "}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": "0.5_abc"}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": "0.5__2"}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": "2.0_0.5"}, "rollout_is_threshold"),
    ({"rollout_is": "sequence", "rollout_is_threshold": 0}, "rollout_is_threshold"),
    ({"rollout_is": "sequence", "rollout_is_threshold": -1.5}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": "0_2"}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": True}, "rollout_is_threshold"),
    ({"rollout_is": "token", "rollout_is_threshold": [2.0]}, "rollout_is_threshold"),
    ({"rollout_rs": "token_k4", "rollout_rs_threshold": 2.0}, "rollout_rs"),
    ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2.0}, "rollout_rs"),
    ({"rollout_rs": "", "rollout_rs_threshold": 2.0}, "rollout_rs"),
    ({"rollout_rs": " , ", "rollout_rs_threshold": 2.0}, "rollout_rs"),
    ({"rollout_rs": ["token_k1"], "rollout_rs_threshold": 2.0}, "rollout_rs"),
    ({"rollout_rs": "token_k1"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "abc"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": ","}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "2_0.5"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "0"}, "rollout_rs_threshold"),  # verl: ZeroDivisionError
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "inf"}, "rollout_rs_threshold"),  # lower = 1/inf = 0
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "0_2"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": -2.0}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": True}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k3", "rollout_rs_threshold": "0"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k1,token_k2", "rollout_rs_threshold": "2,0.1,0.2"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k1,token_k2,token_k3", "rollout_rs_threshold": "2,0.1"}, "rollout_rs_threshold"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": [0.1]}, "rollout_rs_threshold"),
    ({"bypass_mode": True, "loss_type": "ppo"}, "loss_type"),
]


def verl_refuses(config) -> bool:
    """Whether verl raises on the configuration: its step (decoupled mode), and in bypass mode its loss."""
    from types import SimpleNamespace

    from verl.trainer.ppo.core_algos import compute_policy_loss_bypass_mode

    old, rollout, mask = batch(7, rows=4, length=8)
    try:
        verl_step(old, rollout, mask, config)
        if config.get("bypass_mode"):
            compute_policy_loss_bypass_mode(
                old_log_prob=rollout, log_prob=old, advantages=torch.zeros_like(old), response_mask=mask,
                config=SimpleNamespace(policy_loss={"rollout_correction": config}),
            )
    except (ValueError, TypeError, ZeroDivisionError):
        return True
    return False


@pytest.mark.parametrize("config, key", REFUSED, ids=[f"{key}={next(iter(c.values()))!r}"[:60] for c, key in REFUSED])
def test_what_verl_refuses_is_a_one_line_value_error_naming_the_key(config, key):
    assert verl_refuses(config)
    with pytest.raises(ValueError) as raised:
        Correction.from_config(config)
    message = str(raised.value)
    assert message.startswith(f"{KEY}.{key}: ") and "\n" not in message
    assert isinstance(raised.value, rc.UsageError)  # one line, exit 2, from the CLI


@pytest.mark.parametrize(
    "config",
    [
        None,
        {},
        {"rollout_is": None, "rollout_is_threshold": "not read", "rollout_rs": None},
        {"rollout_is": "token", "rollout_is_threshold": None},  # verl skips the weights silently
        {"rollout_is": "not read either", "rollout_is_threshold": None},
        {"bypass_mode": False, "loss_type": "not read outside bypass mode", "rollout_rs_threshold": "x"},
    ],
)
def test_what_verl_accepts_and_ignores_is_none(config):
    assert Correction.from_config(config) is None
    if config is not None:
        old, rollout, mask = batch(8, rows=4, length=8)
        weights, rejected, _ = verl_step(old, rollout, mask, config)
        assert weights is None and torch.equal(rejected, mask)


def test_settings_round_trip_through_json():
    config = {
        "rollout_is": "token", "rollout_is_threshold": "0.25_4", "rollout_is_batch_normalize": True,
        "rollout_rs": "token_k1,seq_sum_k3,seq_max_k2,token_k1", "rollout_rs_threshold": "0.8_1.25,3.0,0.5",
        "bypass_mode": True, "loss_type": "reinforce",
    }
    correction = Correction.from_config(config)
    assert correction == Correction("token", 4.0, 0.25, True, correction.rejection, True, "reinforce")
    assert [o.name for o in correction.rejection] == ["token_k1", "seq_sum_k3", "seq_max_k2"]
    assert Correction.from_settings(json.loads(json.dumps(correction.settings()))) == correction
    from omegaconf import OmegaConf

    assert Correction.from_config(OmegaConf.create(config)) == correction  # as the trainer holds it
    # settings verl does not read are recorded at their defaults
    bypass_only = Correction.from_config({"bypass_mode": True, "rollout_is_threshold": "junk", "rollout_is_batch_normalize": True})
    assert bypass_only == Correction(None, 2.0, None, False, (), True, "ppo_clip")
    rejection_only = Correction.from_config({"rollout_rs": "token_k2", "rollout_rs_threshold": 1, "loss_type": "reinforce"})
    assert rejection_only.loss_type == "ppo_clip" and rejection_only.rejection[0].upper == 1.0
    with pytest.raises(ValueError):
        RejectionOption("seq_max_k2", "token", "k2", "max", None, 1.0)


# --------------------------------------------------------------------------- hand calculation


def test_token_level_by_hand():
    """One response, old = (−1.0, −0.5, ·, −2.0), rollout = (−1.2, −0.5, ·, −1.0), mask (1, 1, 0, 1)
    (a hole at t = 2: junk there changes nothing): lr = (0.2, 0, ·, −1.0).

    | t | lr   | e^lr     | TIS u=1.2 | IcePop 0.5_1.5 | TIS, normalised | k1 = −lr | k3 = e^lr − 1 − lr |
    |---|------|----------|-----------|----------------|-----------------|----------|--------------------|
    | 0 | 0.2  | 1.221403 | 1.2       | 1.221403       | 1.401935        | −0.2     | 0.021403           |
    | 1 | 0    | 1        | 1         | 1              | 1.168279        | 0        | 0                  |
    | 3 | −1.0 | 0.367879 | 0.367879  | 0 (< 0.5)      | 0.429786        | 1.0      | 0.367879           |

    Normalised: ÷ the mean over the 3 valid tokens, (1.2 + 1 + 0.367879)/3 = 0.855960.
    token_k1 '0.5_2.0' keeps −0.693147 ≤ k1 ≤ 0.693147: t = 0, 1 (t = 3: k1 = 1.0); token_k3 '0.1'
    keeps k3 ≤ 0.1: t = 0, 1.
    """
    old = torch.tensor([[-1.0, -0.5, float("nan"), -2.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.2, -0.5, 7.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1]])
    lr = old - rollout

    def weights(threshold, normalize=False):
        config = {"rollout_is": "token", "rollout_is_threshold": threshold, "rollout_is_batch_normalize": normalize}
        return rc.is_weights(lr, mask, Correction.from_config(config))[0].tolist()

    assert weights(1.2) == pytest.approx([1.2, 1.0, 0.0, 0.367879], abs=1e-6)
    assert weights("0.5_1.5") == pytest.approx([1.221403, 1.0, 0.0, 0.0], abs=1e-6)
    assert weights(1.2, normalize=True) == pytest.approx([1.401935, 1.168279, 0.0, 0.429786], abs=1e-6)
    k1 = Correction.from_config({"rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"})
    k3 = Correction.from_config({"rollout_rs": "token_k3", "rollout_rs_threshold": 0.1})
    assert rc.rejection_statistic(lr, mask, k3.rejection[0])[0, [0, 1, 3]].tolist() == pytest.approx([0.021403, 0.0, 0.367879], abs=1e-6)
    assert (mask * rc.kept(lr, mask, k1)).tolist() == [[1, 1, 0, 0]]
    assert (mask * rc.kept(lr, mask, k3)).tolist() == [[1, 1, 0, 0]]


def test_sequence_level_by_hand():
    """Row 0 the response of test_token_level_by_hand (lr = (0.2, 0, ·, −1.0), Σ = −0.8); row 1:
    old = (−0.3, −0.4, −0.1, ·), rollout = (−0.5, −0.6, −0.3, ·), mask (1, 1, 1, 0): lr = 0.2 each, Σ = 0.6;
    row 2 without a valid token.

    | row | Σ lr | e^Σ      | TIS u=1.5 | normalised | Σk1  | mean k1 | max k2 | mean k3  |
    |-----|------|----------|-----------|------------|------|---------|--------|----------|
    | 0   | −0.8 | 0.449329 | 0.449329  | 0.461009   | 0.8  | 0.2667  | 0.5    | 0.129761 |
    | 1   | 0.6  | 1.822119 | 1.5       | 1.538991   | −0.6 | −0.2    | 0.02   | 0.021403 |
    | 2   | 0    | —        | 0         | 0          | 0    | 0       | 0      | 0        |

    The weight is the row's on each of its valid tokens. Normalised: ÷ the mean over the two rows
    with a valid token, (0.449329 + 1.5)/2 = 0.974664. With ratio bounds '0.5_2.0' (k1 within
    ±0.693147) seq_sum_k1 rejects row 0, seq_mean_k1 keeps both; seq_max_k2 '0.3' and seq_mean_k3
    '0.1' reject row 0.
    """
    nan = float("nan")
    old = torch.tensor([[-1.0, -0.5, nan, -2.0], [-0.3, -0.4, -0.1, nan], [nan] * 4], dtype=torch.float64)
    rollout = torch.tensor([[-1.2, -0.5, 0.0, -1.0], [-0.5, -0.6, -0.3, 3.0], [0.0] * 4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0], [0, 0, 0, 0]])
    lr = old - rollout
    tis = Correction.from_config({"rollout_is": "sequence", "rollout_is_threshold": 1.5})
    w0, w1 = 0.449329, 1.5
    assert rc.is_weights(lr, mask, tis).tolist() == [pytest.approx(row, abs=1e-6) for row in ([w0, w0, 0, w0], [w1, w1, w1, 0], [0] * 4)]
    n0, n1 = 0.461009, 1.538991
    normalized = rc.is_weights(lr, mask, dataclasses.replace(tis, batch_normalize=True))
    assert normalized.tolist() == [pytest.approx(row, abs=1e-6) for row in ([n0, n0, 0, n0], [n1, n1, n1, 0], [0] * 4)]
    expected = {"seq_sum_k1": [0.8, -0.6, 0], "seq_mean_k1": [0.8 / 3, -0.2, 0], "seq_max_k2": [0.5, 0.02, 0], "seq_mean_k3": [0.129761, 0.021403, 0]}
    thresholds = {"seq_sum_k1": "0.5_2.0", "seq_mean_k1": "0.5_2.0", "seq_max_k2": "0.3", "seq_mean_k3": "0.1"}
    rows_kept = {"seq_sum_k1": [False, True], "seq_mean_k1": [True, True], "seq_max_k2": [False, True], "seq_mean_k3": [False, True]}
    for name, values in expected.items():
        correction = Correction.from_config({"rollout_rs": name, "rollout_rs_threshold": thresholds[name]})
        statistic = rc.rejection_statistic(lr, mask, correction.rejection[0])
        assert statistic[:, 0].tolist() == pytest.approx(values, abs=1e-6) and bool((statistic == statistic[:, :1]).all())
        assert rc.kept(lr, mask, correction)[:2, 0].tolist() == rows_kept[name], name


def test_holes_and_empty_rows_hold_no_junk():
    """Whatever a masked position holds (NaN, ±inf), it moves nothing: weights 0 there, statistics,
    verdicts and bounds of the valid tokens as with 0 there."""
    old, rollout, mask = batch(9, length=24)
    lr = (old - rollout).double()
    holes = int((~mask.bool()).sum())
    junk = lr.clone()
    junk[~mask.bool()] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64).repeat(holes)[:holes]
    clean = lr.masked_fill(~mask.bool(), 0.0)
    valid = mask.bool()
    for level in ("token", "sequence"):
        for threshold in (2.0, "0.5_2.0"):
            correction = Correction.from_config({"rollout_is": level, "rollout_is_threshold": threshold, "rollout_is_batch_normalize": True})
            weights = rc.is_weights(junk, mask, correction)
            assert torch.equal(weights, rc.is_weights(clean, mask, correction)) and bool((weights[~valid] == 0).all())
            assert torch.equal(rc.weight_error_bound(junk, mask, correction), rc.weight_error_bound(clean, mask, correction))
    for name in rc.OPTIONS:
        spec = "0.7_1.4" if name.endswith("k1") else "0.05"
        correction = Correction.from_config({"rollout_rs": name, "rollout_rs_threshold": spec})
        option = correction.rejection[0]
        if option.level == "sequence":  # token-level statistics are the token's own, masked or not
            assert torch.equal(rc.rejection_statistic(junk, mask, option), rc.rejection_statistic(clean, mask, option))
            assert torch.equal(rc.statistic_error_bound(junk, mask, option), rc.statistic_error_bound(clean, mask, option))
            assert bool((rc.rejection_statistic(junk, mask, option)[0] == 0).all())  # the row without a valid token
        assert torch.equal(mask * rc.kept(junk, mask, correction), mask * rc.kept(clean, mask, correction))


# --------------------------------------------------------------------------- the error bounds


def adversarial(kind: str, seed: int = 0, rows: int = 6, length: int = 512):
    """float32 log-probs (B, 512) that stress float32: near −20 (large inputs, small ratios), across the
    ±20 clamp, near 0 (k3's cancellation), rows of 512 equal log-ratios (a sum's rounding errors
    aligned) and a mixture; one row with holes, one without a valid token."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.rand(*shape, generator=g)  # noqa: E731
    if kind == "near_minus_20":
        old, rollout = -20 + 0.5 * rand(rows, length), -20 + 0.5 * rand(rows, length)
    elif kind == "across_the_clamp":
        near_zero, near_twenty = -1e-3 * rand(rows, length), -20 + 0.02 * (rand(rows, length) - 0.5)
        flip = (torch.arange(rows) % 2 == 0)[:, None]
        old, rollout = torch.where(flip, near_zero, near_twenty), torch.where(flip, near_twenty, near_zero)
    elif kind == "near_0":
        old, rollout = -1e-6 * rand(rows, length), -1e-6 * rand(rows, length)
    elif kind == "equal_terms":
        old = torch.full((rows, length), -1.3)
        step = torch.linspace(-0.04, 0.045, rows)[:, None] + 1e-3 * rand(rows, 1)
        rollout = (old.double() - step.double()).float().expand(rows, length).contiguous()
    else:
        old = -20 * rand(rows, length)
        rollout = old + torch.randn(rows, length, generator=g) * torch.logspace(-6, 0.5, length)
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, ::3] = 0
    mask[1, 400:] = 0
    mask[2] = 0
    return old.float(), rollout.float(), mask


KINDS = ["near_minus_20", "across_the_clamp", "near_0", "equal_terms", "mixture"]


@pytest.mark.parametrize("kind", KINDS)
def test_weight_bounds_hold_on_verls_float32(kind):
    """verl on the float32 log-probs against verl on the same numbers in float64: every weight within
    weight_error_bound, for each level, TIS (truncating and not) and IcePop, with and without batch
    normalisation; at IcePop's bounds either 0 or the weight."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights

    old, rollout, mask = adversarial(kind)
    lr64 = old.double() - rollout.double()
    for level in ("token", "sequence"):
        for threshold in (2.0, 1e9, "0.5_2.0", "1e-3_1e3"):
            for normalize in (False, True):
                correction = Correction.from_config({"rollout_is": level, "rollout_is_threshold": threshold, "rollout_is_batch_normalize": normalize})
                if not rc.is_weights(lr64, mask, correction).any():
                    # IcePop zeroed every weight: verl's effective sample size divides by their mean, 0
                    with pytest.raises(ZeroDivisionError):
                        compute_rollout_correction_weights(old - rollout, mask, level, threshold, normalize)
                    continue
                w32, _ = compute_rollout_correction_weights(old - rollout, mask, level, threshold, normalize)
                w64, _ = compute_rollout_correction_weights(lr64, mask, level, threshold, normalize)
                bound = rc.weight_error_bound(lr64, mask, correction)
                error = (w32.double() - w64).abs()
                within = error <= bound
                if correction.is_lower is not None:
                    plain = dataclasses.replace(correction, is_upper=math.inf, is_lower=None, batch_normalize=False)
                    raw = rc.is_weights(lr64, mask, plain)
                    near = rc.weight_error_bound(lr64, mask, dataclasses.replace(correction, batch_normalize=False))
                    ambiguous = ((raw - correction.is_lower).abs() <= near) | ((raw - correction.is_upper).abs() <= near)
                    assert not (normalize and ambiguous.any())
                    within |= ambiguous & ((w32 == 0) | ((w32.double() - raw).abs() <= near))
                assert bool(within.all()), (level, threshold, normalize, (error / bound)[~within][:5])


@pytest.mark.parametrize("kind", KINDS)
def test_statistic_bounds_hold_on_verls_float32(kind, verl_statistics):
    """verl's own statistics (captured as it passes them to its metrics) on the float32 log-probs
    against the same in float64: within statistic_error_bound; and with thresholds planted at
    statistics themselves, a verdict differs only within the bound of the threshold."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    old, rollout, mask = adversarial(kind)
    lr32, lr64 = old - rollout, old.double() - rollout.double()
    valid = mask.bool()
    for name in sorted(rc.OPTIONS):
        level, statistic, aggregate = rc.OPTIONS[name]
        option = RejectionOption(name, level, statistic, aggregate, -1.0 if statistic == "k1" else None, 1.0)
        s64 = rc.rejection_statistic(lr64, mask, option)
        bound = rc.statistic_error_bound(lr64, mask, option)
        # thresholds at the float64 and the float32 statistics of some valid tokens
        planted = torch.cat([s64[valid][::97], rc.rejection_statistic(lr32, mask, option)[valid][::89].double()])
        planted = planted[planted > 0] if statistic != "k1" else planted[planted.abs() < 50]  # exp(value) a positive float
        for index, value in enumerate(planted.tolist()[:8]):
            if statistic != "k1":
                spec = repr(value)
            elif index % 2:  # the upper bound planted
                spec = f"{math.exp(min(value, 0.0) - 1)!r}_{math.exp(value)!r}"
            else:  # the lower one
                spec = f"{math.exp(value)!r}_{math.exp(max(value, 0.0) + 1)!r}"
            m32, _ = compute_rollout_rejection_mask(lr32, mask, name, spec)
            s32 = verl_statistics[name].double()
            m64, _ = compute_rollout_rejection_mask(lr64, mask, name, spec)
            error = (s32 - verl_statistics[name]).abs()
            assert bool((error <= bound).all()), (name, (error / bound).max())
            threshold = Correction.from_config({"rollout_rs": name, "rollout_rs_threshold": spec}).rejection[0]
            near = torch.zeros_like(valid)
            for edge in (threshold.lower, threshold.upper):
                if edge is not None:
                    near |= (s64 - edge).abs() <= bound
            assert bool((near | (m32 == m64)).all()), (name, spec)


def test_bounds_are_tight_enough_to_catch_a_planted_error():
    """The bounds are rounding, not slack: on ordinary log-probs (|lr| ≲ 1, 48 tokens) a weight or
    statistic moved by 1e-4 of itself is far outside them."""
    old, rollout, mask = batch(10)
    lr = (old - rollout).double()
    valid = mask.bool()
    for level in ("token", "sequence"):
        correction = Correction.from_config({"rollout_is": level, "rollout_is_threshold": 1e9, "rollout_is_batch_normalize": True})
        weights = rc.is_weights(lr, mask, correction)
        assert bool((rc.weight_error_bound(lr, mask, correction)[valid] < 1e-4 * weights[valid]).all())
    for name in rc.OPTIONS:
        level, statistic, aggregate = rc.OPTIONS[name]
        option = RejectionOption(name, level, statistic, aggregate, -1.0 if statistic == "k1" else None, 1.0)
        value = rc.rejection_statistic(lr, mask, option)[valid].abs()
        bound = rc.statistic_error_bound(lr, mask, option)[valid]
        assert bool((bound[value > 1e-2] < 1e-4 * value[value > 1e-2]).all()), name

"""The defaults of verl-ext's config keys are written once in Python (the estimator options, TraceOptions'
fields, the defaults of verl_ext.nonfinite and verl_ext.metrics); configs/verl_ext_trainer.yaml, which hydra needs as a file,
must declare the same keys with the same defaults. (That it composes onto verl's ppo_trainer:
tests/integration/test_verl_seam.py.) A malformed ``verl_ext`` node is named as such."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from verl_ext.options import ALGORITHM_KEYS, METRICS_DEFAULT, NONFINITE_DEFAULT, TRACE_KEYS, TURN_REWARDS_DEFAULT, TraceOptions

YAML = Path(__file__).resolve().parents[1] / "verl_ext" / "configs" / "verl_ext_trainer.yaml"


def test_the_yaml_declares_every_key_with_the_default_of_the_code():
    declared = yaml.safe_load(YAML.read_text())
    assert declared["algorithm"] == ALGORITHM_KEYS
    assert declared["verl_ext"] == {
        "nonfinite": NONFINITE_DEFAULT, "metrics": METRICS_DEFAULT, "turn_rewards": TURN_REWARDS_DEFAULT, "trace": TraceOptions().as_dict()
    }  # fmt: skip


def test_the_trace_keys_are_the_fields_of_trace_options_in_order():
    assert list(TRACE_KEYS) == ["dir", "every", "max_samples_per_step", "on_error", "queue_size", "update"]
    assert TraceOptions.from_config({"verl_ext": {"trace": {}}}) == TraceOptions()


@pytest.mark.parametrize(
    "verl_ext, message",
    [
        ({"trace": 5}, r"verl_ext.trace must be a node of options \(dir, every, .*\), got 5$"),
        (5, r"verl_ext must be a node of options \(e.g. verl_ext.trace.dir=/runs/trace\), got 5"),
        ({"trace": "/tmp/x"}, r"got '/tmp/x'; to trace into a directory write verl_ext.trace.dir=/tmp/x"),
    ],
)
def test_a_malformed_verl_ext_node_is_named(verl_ext, message):
    with pytest.raises(ValueError, match=message):
        TraceOptions.from_config({"verl_ext": verl_ext})

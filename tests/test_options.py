"""The defaults of verl-ext's config keys are written once in Python (the estimator options, TraceOptions'
fields, the defaults of verl_ext.nonfinite and verl_ext.metrics); configs/verl_ext_trainer.yaml, which hydra needs as a file,
must declare the same keys with the same defaults. (That it composes onto verl's ppo_trainer:
tests/integration/test_verl_seam.py.)"""

from __future__ import annotations

from pathlib import Path

import yaml

from verl_ext.options import ALGORITHM_KEYS, METRICS_DEFAULT, NONFINITE_DEFAULT, TRACE_KEYS, TraceOptions

YAML = Path(__file__).resolve().parents[1] / "verl_ext" / "configs" / "verl_ext_trainer.yaml"


def test_the_yaml_declares_every_key_with_the_default_of_the_code():
    declared = yaml.safe_load(YAML.read_text())
    assert declared["algorithm"] == ALGORITHM_KEYS
    assert declared["verl_ext"] == {"nonfinite": NONFINITE_DEFAULT, "metrics": METRICS_DEFAULT, "trace": TraceOptions().as_dict()}


def test_the_trace_keys_are_the_fields_of_trace_options_in_order():
    assert list(TRACE_KEYS) == ["dir", "every", "max_samples_per_step", "on_error", "queue_size", "update"]
    assert TraceOptions.from_config({"verl_ext": {"trace": {}}}) == TraceOptions()

"""The README's example of a user's estimator, registered before or after verl's core_algos, inside
verl's compute_advantage (both trainers' path), the critic rule and validation. The end-to-end run
through verl's trainer, with the trace and the checker, is in tests/e2e/test_fit_with_trace.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.integration.conftest import run_python

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    block = re.search(r"<!-- example: register_estimator -->\n```python\n(.*?)```\n<!-- /example -->", text, re.S)
    assert block, "README lost its register_estimator example"
    return block.group(1)


@pytest.fixture(scope="module")
def example_module(tmp_path_factory) -> Path:
    """The README's example, saved as the module it says it is."""
    directory = tmp_path_factory.mktemp("user_module")
    (directory / "my_estimators.py").write_text(readme_example())
    return directory


def test_the_readme_example_is_ten_lines_or_so():
    code = [line for line in readme_example().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert len(code) <= 10


PROBE = """
import json, sys
{first}
from verl_ext import registry
from verl.trainer.ppo import core_algos, ray_trainer
from verl.trainer.ppo.utils import need_critic
from omegaconf import OmegaConf
import torch, numpy as np
from verl import DataProto
sys.path.insert(0, {tests!r})
import tests.reference as ref
from tests.integration.conftest import make_batch

rewards, values, mask = make_batch(seed=11)
config = OmegaConf.create({{"algorithm": {{"adv_estimator": "td_half", "gamma": 0.9, "lam": 1.0}}, "critic": {{"enable": None}}}})
data = DataProto.from_dict(tensors={{"token_level_rewards": rewards, "values": values, "response_mask": mask}})
data = ray_trainer.compute_advantage(data, adv_estimator="td_half", gamma=0.9, lam=1.0, config=config.algorithm)
valid = mask.bool().numpy()
raw = ref.gae_advantages(rewards, values, mask, 0.9, 0.5)
print(json.dumps({{
    "in_verl": "td_half" in core_algos.ADV_ESTIMATOR_REGISTRY,
    "in_verl_ext": "td_half" in registry.names(),
    "critic": need_critic(config),
    "returns_error": float(np.abs(data.batch["returns"].numpy() - (raw + values.numpy()))[valid].max()),
    "advantages_error": float(np.abs(data.batch["advantages"].numpy() - ref.whiten(raw, mask))[valid].max()),
}}))
"""


@pytest.mark.parametrize(
    "first",
    [
        "import my_estimators",  # the decorator runs before verl's core_algos is imported
        "import verl.trainer.ppo.core_algos, my_estimators",  # ... and after
    ],
    ids=["before-core_algos", "after-core_algos"],
)
def test_registered_before_or_after_core_algos_it_runs_inside_verl(example_module, first):
    tests_root = str(Path(__file__).resolve().parents[2])
    result = run_python(PROBE.format(first=first, tests=tests_root), {"PYTHONPATH": f"{example_module}:{tests_root}"})
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["in_verl"] and report["in_verl_ext"] and report["critic"] is True
    assert report["returns_error"] < 1e-5 and report["advantages_error"] < 1e-4


def test_loaded_through_verl_use_external_modules(example_module):
    result = run_python(
        "import verl; from verl.trainer.ppo import core_algos; print('td_half' in core_algos.ADV_ESTIMATOR_REGISTRY)",
        {"PYTHONPATH": str(example_module), "VERL_USE_EXTERNAL_MODULES": "my_estimators"},
    )
    assert result.stdout.strip().splitlines()[-1] == "True", result.stderr[-3000:]


def test_a_name_verl_already_uses_is_refused_with_both_names(example_module):
    result = run_python(
        "import verl.trainer.ppo.core_algos, verl_ext\n"
        "try:\n    verl_ext.register_estimator('grpo')(lambda *a, **k: None)\nexcept ValueError as e:\n    print(e)"
    )
    assert "verl refuses estimator name 'grpo'" in result.stdout, result.stderr[-3000:]

"""The README's example of a user's estimator, registered before or after verl's core_algos, inside
verl's compute_advantage (both trainers' path), the critic rule and validation. The end-to-end run
through verl's trainer, with the trace and the checker, is in tests/e2e/test_fit_with_trace.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.integration.conftest import run_python
from tests.support.registry_helpers import isolated_registry  # noqa: F401 - a fixture

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    block = re.search(r"<!-- example: register_estimator -->\n```python\n(.*?)```\n<!-- /example -->", text, re.S)
    assert block, "README lost its register_estimator example"
    return block.group(1)


def td_half_trace(directory: Path, gamma: float = 0.9) -> str:
    """Two steps of a run of the README's td_half (whitened, KL in the reward), its numbers from the
    direct sums of GAE(γ, λ = 0.5): its run record names td_half and its module ``my_estimators``, as a
    real run's does (tests/e2e/test_fit_with_trace.py: the same checks on the run itself)."""
    from tests.inspect.inspect_helpers import algorithm, by_definition, random_batch, write_trace

    algo = algorithm("td_half", gamma=gamma, kl="low_var_kl", whiten_advantages=True, estimator_module="my_estimators")
    batches = {step: by_definition(random_batch(step, kl_coef=0.05), "gae_ext", gamma, lam=0.5) for step in (1, 2)}
    return write_trace(directory, algo, batches)


def verl_ext_command(argv: list[str], cwd: Path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """``verl-ext ARGV`` through its console script, as a user types it in ``cwd``: unlike ``python -c``
    or ``python -m``, a console script does not put the current directory on sys.path."""
    script = Path(sysconfig.get_path("scripts"), "verl-ext")
    assert script.is_file(), f"{script}: the console script of the installed package"
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VERL_USE_EXTERNAL_MODULES")}
    # what its #! line does, with the suite's interpreter (tests/support/forkserver.py)
    return subprocess.run([sys.executable, str(script), *argv], cwd=cwd, env={**env, **(env_extra or {})}, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def example_module(tmp_path_factory) -> Path:
    """The README's example, saved as the module it says it is."""
    directory = tmp_path_factory.mktemp("user_module")
    (directory / "my_estimators.py").write_text(readme_example())
    return directory


def test_the_readme_example_is_ten_lines_or_so(isolated_registry):
    """"With one decorator": about ten lines of code that, run as the module they say they are,
    register td_half (with a critic, the default) and nothing else, and compute TD(λ = 0.5)."""
    import torch

    code = [line for line in readme_example().splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert sum(line.startswith("@") for line in code) == 1 and len(code) <= 10
    before = set(isolated_registry.names())
    module = {"__name__": "my_estimators"}
    exec(compile(readme_example(), "my_estimators.py", "exec"), module)
    assert set(isolated_registry.names()) - before == {"td_half"}
    assert isolated_registry.get("td_half").needs_critic and isolated_registry.get("td_half").fn is module["td_half"]
    # by hand, γ = 0.5: δ = [0 + 0.5·0.4 − 0.2, 0 + 0.5·0.6 − 0.4, 1 − 0.6] = [0, −0.1, 0.4];
    # A_t = δ_t + γ·0.5·A_{t+1} = [0 + 0.25·0, −0.1 + 0.25·0.4, 0.4] = [0, 0, 0.4] whatever lam says; returns A + V
    rewards, values, mask = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.2, 0.4, 0.6]]), torch.ones(1, 3)
    for lam in (0.0, 1.0):
        returns, advantage = module["td_half"](rewards, values, mask, gamma=0.5, lam=lam, config={"lam": lam})
        torch.testing.assert_close(advantage, torch.tensor([[0.0, 0.0, 0.4]]))
        torch.testing.assert_close(returns, torch.tensor([[0.2, 0.4, 1.0]]))


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
import tests.support.reference as ref
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


@pytest.fixture(scope="module")
def gae_ext_trace(tmp_path_factory):
    """A traced step of another estimator (gae_ext, γ = 0.9), on which td_half is re-estimated."""
    from tests.inspect.inspect_helpers import algorithm, by_definition, random_batch, write_trace

    batch = by_definition(random_batch(3, B=4, T=12), "gae_ext", 0.9, lam=0.7)
    return write_trace(tmp_path_factory.mktemp("user_trace"), algorithm("gae_ext", gamma=0.9, lam=0.7), {2: batch}), batch


def test_the_cli_recomputes_the_users_estimator_named_in_verl_use_external_modules(example_module, gae_ext_trace):
    """`VERL_USE_EXTERNAL_MODULES=my_estimators verl-ext compare`: the README's td_half is a column,
    equal to GAE(γ, 0.5) by the direct sums; `check` of the same trace passes with the module loaded."""
    import numpy as np

    import tests.support.reference as ref

    path, batch = gae_ext_trace
    env = {"PYTHONPATH": str(example_module), "VERL_USE_EXTERNAL_MODULES": "my_estimators"}
    result = run_python(f"from verl_ext import cli; raise SystemExit(cli.main(['compare', {str(path)!r}, '--step', '2', '--sample', '1', '--format', 'csv']))", env)
    assert result.returncode == 0, result.stderr[-3000:]
    header, *rows = result.stdout.strip().splitlines()
    assert "td_half" in header.split(","), header
    column = header.split(",").index("td_half")
    mask = batch.mask.numpy()
    expected = ref.gae_advantages(batch.rewards.double().numpy(), batch.values.double().numpy(), mask, 0.9, 0.5)[1, np.flatnonzero(mask[1])]
    np.testing.assert_allclose([float(row.split(",")[column]) for row in rows], expected, rtol=1e-6, atol=1e-7)
    result = run_python(f"from verl_ext import cli; raise SystemExit(cli.main(['check', {str(path)!r}, '-q']))", env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.parametrize("command", ["compare", "check", "view"])
def test_a_module_that_cannot_be_imported_is_one_line_and_exit_2(gae_ext_trace, command):
    path, _ = gae_ext_trace
    argv = {"compare": ["--step", "2"], "check": [], "view": ["--out", "/dev/null"]}[command]
    result = run_python(f"from verl_ext import cli; raise SystemExit(cli.main({[command, str(path), *argv]!r}))", {"VERL_USE_EXTERNAL_MODULES": "no_such_module"})
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        f"verl-ext {command}: cannot import no_such_module (VERL_USE_EXTERNAL_MODULES): No module named 'no_such_module'; "
        "put the directory that holds no_such_module.py (or the package no_such_module/) on PYTHONPATH, or run from it\n"
    )


# ---------------------------------------------------------------- a run of td_half, checked where its module is and is not


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory) -> str:
    return td_half_trace(tmp_path_factory.mktemp("td_half") / "trace")


def test_check_of_a_td_half_run_recomputes_it_where_its_module_imports(example_module, readme_run, tmp_path):
    """With the module on PYTHONPATH (not named in VERL_USE_EXTERNAL_MODULES: the run record names it),
    the estimator is recomputed and every identity that applies holds: PASS, exit 0."""
    result = verl_ext_command(["check", readme_run, "-q", "--json"], tmp_path, {"PYTHONPATH": str(example_module)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["verdict"] == "pass" and report["passed"] is True and report["not_checked"] == []
    statuses = {identity["identity"]: identity["status"] for identity in report["identities"]}
    assert statuses["advantage_raw"] == statuses["returns"] == statuses["whitening"] == "pass"


def test_check_of_a_td_half_run_is_incomplete_where_its_module_does_not_import(readme_run, tmp_path):
    """Without the module: never PASS. The estimator's identities are not checked (not "not
    applicable"); the rest, whitening included (the record says the run whitened), still are."""
    result = verl_ext_command(["check", readme_run, "-q"], tmp_path)
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    fix = (
        "estimator 'td_half' is not importable here: No module named 'my_estimators'; put the directory that "
        "holds my_estimators.py (or the package my_estimators/) on PYTHONPATH, or run from it"
    )
    assert result.stdout.splitlines()[-1] == f"INCOMPLETE (8 passed, 0 failed, 2 not checked, 1 skipped): {fix}"
    assert "PASS" not in result.stdout
    assert "estimator: td_half, whitened, KL in reward (low_var_kl)" in result.stdout

    accepted = verl_ext_command(["check", readme_run, "-q", "--allow-unchecked"], tmp_path)
    assert accepted.returncode == 0, accepted.stdout[-3000:] + accepted.stderr[-3000:]
    last = accepted.stdout.splitlines()[-1]
    assert last == f"INCOMPLETE, accepted by --allow-unchecked (8 passed, 0 failed, 2 not checked, 1 skipped): {fix}"


@pytest.mark.parametrize("command", ["compare", "check", "view"])
def test_a_module_in_the_current_directory_is_found_by_every_command(readme_run, tmp_path, command):
    """Run where my_estimators.py is, as `python -m verl.trainer.main_ppo` finds it there: the module of
    VERL_USE_EXTERNAL_MODULES (compare shows td_half, the view is written), and the module the run
    record names (check recomputes td_half without the variable)."""
    (tmp_path / "my_estimators.py").write_text(readme_example())
    argv = {"compare": ["--step", "2", "--format", "csv"], "check": ["-q", "--json"], "view": ["--out", str(tmp_path / "page.html"), "-q"]}
    env = {} if command == "check" else {"VERL_USE_EXTERNAL_MODULES": "my_estimators"}
    result = verl_ext_command([command, readme_run, *argv[command]], tmp_path, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if command == "compare":
        assert "td_half" in result.stdout.splitlines()[0].split(",")
    if command == "check":
        assert json.loads(result.stdout)["verdict"] == "pass"

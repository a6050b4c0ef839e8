"""Issue 11, case by case: each test reproduces what a hostile user found, on a small trace written by
the real TraceWriter (the demo's trace has the same layout), and pins the fix. The multi-node run is
in tests/e2e/test_multinode.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.inspect.inspect_helpers import algorithm, by_definition, random_batch, write_trace
from tests.trace.conftest import hooked_url  # noqa: F401 - a fixture
from verl_ext.errors import UsageError
from verl_ext.options import TraceOptions

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def trace(tmp_path) -> Path:
    """Three steps of td0 with KL in the reward (steps 1, 2, 3; step 3 also as the record's last)."""
    batches = {step: by_definition(random_batch(step, kl_coef=0.1), "td0", gamma=1.0) for step in (1, 2, 3)}
    return Path(write_trace(tmp_path / "trace", algorithm("td0", kl="kl"), batches))


# 1 -------------------------------------------------------------------------------------------------


def test_1_a_second_directory_of_the_same_step_is_refused_not_half_read(trace, run_cli):
    shutil.copytree(trace / "step-3", trace / "step-03")
    for command in ("check", "summary", "show"):
        code, out, err = run_cli(command, str(trace))
        assert code == 2 and out == "", command
        assert err.strip() == (
            f"verl-ext {command}: {trace}/step-03 is not a directory this trace writes: step 3 lives in step-3; "
            "remove or rename the copy"
        )


# 2 -------------------------------------------------------------------------------------------------


def test_2_a_step_of_the_run_record_missing_on_disk_fails_the_check(trace, run_cli):
    shutil.rmtree(trace / "step-3")
    code, out, _ = run_cli("check", str(trace), "--quiet")
    assert code == 1
    assert "checked:   2 steps" in out
    assert "8.5  every step and update table of the run record is on disk" in out and "FAIL (1 file)" in out
    assert "step 3: step-3/part-0.parquet: listed in the run record, missing on disk" in out


# 3 -------------------------------------------------------------------------------------------------


def readme_readers(path: str) -> dict[str, object]:
    """What each of the README's one-line readers of the token table returns for ``path``, by library."""
    import re

    block = re.search(r"<!-- readers -->\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    namespace: dict = {}
    results = {}
    for line in block.replace("PATH", path).splitlines():
        code = line.split("  #")[0].strip()
        if not code:
            continue
        if code.startswith("import") or re.match(r"\w+ = ", code):
            exec(code, namespace)  # noqa: S102 - the README's own lines
        else:
            results[re.match(r"\w+", code).group(0)] = eval(code, namespace)  # noqa: S307
    return results


def test_3_every_readme_reader_gives_an_integer_step_that_sorts_numerically(tmp_path):
    """With each library's plain call: no partitioning or hive options to remember (issue 18)."""
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("<!-- readers -->") :].split("```")[1]
    assert "partitioning" not in block and "hive" not in block
    batches = {step: by_definition(random_batch(step), "mc", gamma=1.0) for step in (1, 2, 3, 10, 11, 20)}
    readers = readme_readers(write_trace(tmp_path / "t", algorithm("mc"), batches))
    assert set(readers) == {"ds", "pd", "pl", "duckdb"}
    for name, result in readers.items():
        frame = {"ds": lambda r: r.to_table().to_pandas(), "pd": lambda r: r, "pl": lambda r: r.to_pandas(),
                 "duckdb": lambda r: r.df()}[name](result)  # fmt: skip
        assert str(frame["step"].dtype) == "int64", name
        assert sorted(frame["step"].unique().tolist()) == [1, 2, 3, 10, 11, 20], name
        assert frame.sort_values("step", kind="stable")["step"].is_monotonic_increasing, name
        assert set(frame[frame["step"] < 5]["step"]) == {1, 2, 3}, name


# 4, 5 ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", ["0", "-1", "two"])
def test_4_demo_refuses_a_step_count_below_one(run_cli, steps, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("demo", "--steps", steps, "--output-dir", str(tmp_path))
    assert exit_info.value.code == 2


def test_5_bad_digits_and_an_unwritable_demo_directory_are_one_line(trace, run_cli, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("show", str(trace), "--digits", "-3")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --digits: must be >= 0, got -3" in err and "Traceback" not in err
    code, _, err = run_cli("demo", "--output-dir", "/proc/x")
    assert code == 2 and err.startswith("verl-ext demo: cannot write the demo's outputs to /proc/x:") and err.count("\n") == 1


@pytest.mark.parametrize("command", ["show --format csv", "summary", "check"])
def test_5_a_reader_that_goes_away_is_not_an_error(trace, command):
    """``verl-ext ... | head -1``: no traceback, and the command's own exit code (0 here), not 1."""
    pipeline = f"{sys.executable} -m verl_ext.cli {command} {trace} | head -1; echo \"status ${{PIPESTATUS[0]}}\""
    result = subprocess.run(["bash", "-c", pipeline], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
    assert result.stdout.splitlines()[-1] == "status 0"


# 6, 7, 11 -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "verl_ext, message",
    [
        ({"trace": 5}, r"verl_ext.trace must be a node of options \(dir, every, .*\), got 5$"),
        (5, r"verl_ext must be a node of options \(e.g. verl_ext.trace.dir=/runs/trace\), got 5"),
        ({"trace": "/tmp/x"}, r"got '/tmp/x'; to trace into a directory write verl_ext.trace.dir=/tmp/x"),
    ],
)
def test_6_a_malformed_verl_ext_node_is_named(verl_ext, message):
    with pytest.raises(ValueError, match=message):
        TraceOptions.from_config({"verl_ext": verl_ext})


def test_7_verl_ext_options_are_checked_with_verls_own_estimators():
    from verl_ext import registry

    with pytest.raises(ValueError, match=r"algorithm.n_step must be an integer >= 1, got -5"):
        registry.check_algorithm({"adv_estimator": "gae", "n_step": -5, "lam_critic": 7})
    with pytest.raises(ValueError, match=r"algorithm.lam_critic must be in \[0, 1\], got 7"):
        registry.check_algorithm({"adv_estimator": "gae", "lam_critic": 7})
    with pytest.warns(UserWarning, match="algorithm.adv_estimator=gae ignores algorithm.n_step"):
        registry.check_algorithm({"adv_estimator": "gae", "n_step": 5, "whiten_advantages": True})


def test_11_verls_typed_algorithm_config_works_with_a_verl_ext_estimator():
    """compute_advantage(..., config=AlgoConfig(...)), as verl's signature advertises."""
    from verl import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import ray_trainer

    import tests.reference as ref

    rewards, values = torch.randn(4, 7, generator=torch.Generator().manual_seed(2)), torch.randn(4, 7)
    mask = torch.ones(4, 7, dtype=torch.int64)
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "values": values, "response_mask": mask})
    config = AlgoConfig(gamma=0.9, lam=0.8, adv_estimator="mc")
    data = ray_trainer.compute_advantage(data, adv_estimator="mc", gamma=0.9, lam=0.8, config=config)
    np.testing.assert_allclose(data.batch["returns"].numpy(), ref.mc_returns(rewards, mask, 0.9), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="algorithm.adv_estimator=nstep needs algorithm.n_step"):
        ray_trainer.compute_advantage(data, adv_estimator="nstep", gamma=0.9, lam=0.8, config=config)


# 8 -------------------------------------------------------------------------------------------------


def test_8_a_nan_return_is_reported_where_it_is_not_as_a_whitening_error(tmp_path, run_cli):
    batches = {step: by_definition(random_batch(step), "td0", gamma=1.0) for step in (1, 2)}
    batches[2].returns[1, 2] = float("nan")
    code, out, _ = run_cli("check", write_trace(tmp_path / "t", algorithm("td0"), batches), "--quiet")
    assert code == 1
    lines = {line.split("  ")[1]: line for line in out.splitlines() if line[:1] == "8"}
    assert lines["advantages = masked_whiten(raw advantage)"].endswith("pass")
    assert "return = nan: not finite" in out
    assert "entrys" not in out and "FAIL (1 token)" in out


# 9 -------------------------------------------------------------------------------------------------


def test_9_a_bad_plot_request_writes_nothing(trace, run_cli, tmp_path):
    out = tmp_path / "plots"
    code, _, err = run_cli("plot", str(trace), "--out", str(out), "--sample", "999")
    assert code == 2 and "has no sample 999" in err
    assert not out.exists()


def test_9_a_failed_step_leaves_no_prompt_table_behind(hooked_url):
    from tests.trace.helpers import HookedMemoryFileSystem, fail_writes_to, make_capture, run_record
    from verl_ext.trace.writer import TraceWriter

    HookedMemoryFileSystem.on_write = fail_writes_to("step-2/part-0.parquet")
    with pytest.warns(RuntimeWarning, match="writing step 2"):
        with TraceWriter(TraceOptions(dir=hooked_url), run_record()) as writer:
            for step in (1, 2):
                writer.submit(make_capture(step))
    fs = HookedMemoryFileSystem()
    prompts = fs.ls(fs._strip_protocol(hooked_url) + "/_prompts", detail=False)
    assert [p.rsplit("/", 1)[1] for p in prompts] == ["step-1.parquet"]


def test_9_with_on_error_raise_the_exit_warning_does_not_promise_training_goes_on(hooked_url):
    from tests.trace.helpers import HookedMemoryFileSystem, fail_writes_to, make_capture, run_record
    from verl_ext.trace.writer import TraceWriter

    HookedMemoryFileSystem.on_write = fail_writes_to("step-1/part-0.parquet")
    with pytest.raises(KeyError), pytest.warns(RuntimeWarning) as caught:
        with TraceWriter(TraceOptions(dir=hooked_url, on_error="raise"), run_record()) as writer:
            writer.submit(make_capture(1))
            raise KeyError("from the trainer")
    messages = [str(w.message) for w in caught]
    assert any("writing step 1" in m and "reported when the trace closed" in m for m in messages)
    assert not any("training goes on" in m for m in messages)


def test_9_checking_the_config_on_the_driver_leaves_nothing_behind(tmp_path):
    from verl_ext.integration.validation import check_trace_dir_writable

    check_trace_dir_writable(str(tmp_path / "new" / "trace"))
    assert list(tmp_path.iterdir()) == []  # not even the directory it had to create
    (tmp_path / "existing").mkdir()
    check_trace_dir_writable(str(tmp_path / "existing"))
    assert list((tmp_path / "existing").iterdir()) == []


# 10 ------------------------------------------------------------------------------------------------


def test_10_a_second_writer_fails_clearly_and_a_killed_one_leaves_no_lock(tmp_path):
    from tests.trace.helpers import make_capture, run_record
    from verl_ext.integration.validation import check_trace_dir_writable
    from verl_ext.trace import lease
    from verl_ext.trace.reader import open_trace
    from verl_ext.trace.writer import TraceWriter

    directory = str(tmp_path / "trace")
    first = TraceWriter(TraceOptions(dir=directory), run_record())
    first.submit(make_capture(1))
    with pytest.raises(UsageError, match=rf"trace dir {directory} is being written by process {os.getpid()} on "):
        TraceWriter(TraceOptions(dir=directory), run_record())
    with pytest.raises(ValueError, match="is being written by process"):  # the driver says so before Ray starts
        check_trace_dir_writable(directory)
    first.submit(make_capture(2))
    first.close()
    assert open_trace(directory).steps == [1, 2] and sorted(open_trace(directory).record.steps) == ["1", "2"]
    assert not (tmp_path / "trace" / lease.LEASE_FILE).exists()

    # a writer killed with -9 leaves its lease; its process is gone, so the lease is dead at once
    child = subprocess.run(
        [sys.executable, "-c",
         "import os, sys; sys.path.insert(0, %r)\n"
         "from tests.trace.helpers import make_capture, run_record\n"
         "from verl_ext.options import TraceOptions\nfrom verl_ext.trace.writer import TraceWriter\n"
         "w = TraceWriter(TraceOptions(dir=%r), run_record()); w.submit(make_capture(3)); w.flush()\n"
         "os.kill(os.getpid(), 9)" % (str(ROOT), directory)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -9 and (tmp_path / "trace" / lease.LEASE_FILE).exists()
    with TraceWriter(TraceOptions(dir=directory), run_record()) as writer:
        writer.submit(make_capture(4))
    assert open_trace(directory).steps == [1, 2, 3, 4]


def test_10_a_writer_whose_lease_was_taken_over_stops_writing(tmp_path, monkeypatch):
    from tests.trace.helpers import make_capture, run_record
    from verl_ext.trace import lease
    from verl_ext.trace.reader import open_trace
    from verl_ext.trace.writer import TraceWriter

    monkeypatch.setattr(lease, "RENEW_SECONDS", 0.05)
    directory = str(tmp_path / "trace")
    writer = TraceWriter(TraceOptions(dir=directory), run_record())
    other = '{"id": "other", "host": "elsewhere", "pid": 1, "started": 0, "renewed": %f}' % time.time()
    (tmp_path / "trace" / lease.LEASE_FILE).write_text(other)
    time.sleep(0.3)  # the writer renews its lease and finds another one
    with pytest.warns(RuntimeWarning, match="another writer took over the trace directory: process 1 on elsewhere"):
        writer.submit(make_capture(1))
        writer.close()
    assert open_trace(directory).steps == []  # it wrote nothing more
    assert (tmp_path / "trace" / lease.LEASE_FILE).read_text() == other  # and left the other's lease alone


# 12, 13, 14 ----------------------------------------------------------------------------------------


def test_12_building_the_package_warns_about_nothing_it_leaves_out(tmp_path):
    """The package (configs/ included) builds without setuptools' 'Package would be ignored'."""
    source = tmp_path / "src"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "would be ignored" not in result.stdout + result.stderr
    import zipfile

    (wheel,) = (tmp_path / "wheel").glob("verl_ext-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "verl_ext/configs/verl_ext_trainer.yaml" in names and not any("__pycache__" in n for n in names)


def test_13_an_empty_run_path_is_refused(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli("check", "")
    assert code == 2 and err.strip() == "verl-ext check: RUN must be a trace directory or URL, got an empty string"


def test_14_a_clean_trace_keeps_no_tmp_directory(trace):
    assert sorted(p.name for p in trace.iterdir()) == ["_prompts", "_run.json", "step-1", "step-2", "step-3"]

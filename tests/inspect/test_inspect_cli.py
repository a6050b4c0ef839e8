"""``verl-ext check|show|summary|plot`` (and ``demo``'s arguments): exit codes, one line (no traceback) for
bad input, and a reader that goes away (``| head -1``)."""

import io
import json
import shutil
import subprocess
import sys

import pytest
from tests.inspect.inspect_helpers import good_trace, rewrite_step

from verl_ext.check.run import check_trace
from verl_ext.inspect.render import ProgressPrinter
from verl_ext.trace.schema import RUN_RECORD, token_file

COMMANDS = ["check", "show", "summary", "plot"]


def break_schema_version(path):
    record = json.loads((path / RUN_RECORD).read_text())
    (path / RUN_RECORD).write_text(json.dumps({**record, "schema_version": 99}))


def corrupt_parquet(path):
    (path / token_file(2)).write_bytes(b"PAR1 this is not parquet")


def drop_a_column(path):
    rewrite_step(str(path), 2, table=lambda t: t.drop_columns(["advantage"]))


def remove_steps(path):
    for step in (1, 2, 3):
        (path / token_file(step)).unlink()


BAD_INPUTS = {
    "missing dir": (lambda path: None, "no trace at {missing}: the path does not exist"),
    "not a trace": (lambda path: None, "{plain} is not a verl-ext trace: it has no _run.json"),
    "unknown schema version": (break_schema_version, "trace schema version 99 is not supported"),
    "corrupt parquet": (corrupt_parquet, f"{token_file(2)} is not a readable Parquet file"),
    "missing column": (drop_a_column, f"{token_file(2)} lacks column(s) advantage"),
    "no steps": (remove_steps, "has no traced steps yet"),
}


#: Damage to one step's file: bad input for a command asked for that step (show, plot --step 2); check and
#: summary go on with the other steps (tests/inspect/test_partial_traces.py).
ONE_STEP = ("corrupt parquet", "missing column")


@pytest.mark.parametrize(
    ("command", "case"),
    [(command, case) for case in BAD_INPUTS for command in COMMANDS if case not in ONE_STEP or command in ("show", "plot")],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, run_cli, command, case):
    damage, message = BAD_INPUTS[case]
    path = tmp_path / "trace"
    good_trace(path)
    damage(path)
    target = {"missing dir": tmp_path / "missing", "not a trace": tmp_path / "plain"}.get(case, path)
    (tmp_path / "plain").mkdir()
    extra = {"show": ["--step", "2"], "plot": ["--out", str(tmp_path / "plots"), "--step", "2"]}.get(command, [])
    code, out, err = run_cli(command, str(target), *extra)
    assert code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"verl-ext {command}: ")
    assert message.format(missing=tmp_path / "missing", plain=tmp_path / "plain") in err


@pytest.mark.parametrize("command", [*COMMANDS, "compare", "view"])
def test_a_run_folder_points_at_the_trace_inside_it(tmp_path, run_cli, command):
    """``verl-ext check RUN_DIR`` where RUN_DIR holds ``trace/`` (the demo's and the recipes' layout):
    the one-line error names RUN_DIR/trace."""
    good_trace(tmp_path / "run" / "trace")
    (tmp_path / "run" / "plots").mkdir()
    extra = {"compare": ["--step", "1"], "view": ["--out", str(tmp_path / "v.html")], "plot": ["--out", str(tmp_path / "p")]}
    code, out, err = run_cli(command, str(tmp_path / "run"), *extra.get(command, []))
    assert (code, out) == (2, "")
    assert err == (
        f"verl-ext {command}: {tmp_path / 'run'} is not a verl-ext trace: it has no _run.json; "
        f"the trace is in {tmp_path / 'run'}/trace: pass that path instead\n"
    )


def test_show_plot_and_view_default_to_the_last_step_and_say_so(tmp_path, run_cli, capsys):
    path = good_trace(tmp_path / "t")  # steps 1, 2, 3
    code, out, _ = run_cli("show", path)
    assert code == 0 and out.startswith("step 3 · sample 0 ·")
    code, out, _ = run_cli("plot", path, "--out", str(tmp_path / "plots"), "--quiet")
    assert code == 0 and "positions_step3.png" in out and "step1" not in out and "step2" not in out
    for command in ("show", "plot", "view"):
        with pytest.raises(SystemExit):
            run_cli(command, "--help")
        help_text = " ".join(capsys.readouterr().out.split())
        assert "(default: the last traced step, the policy as training left it" in help_text, command


def test_check_exit_codes_and_report(tmp_path, run_cli):
    code, out, err = run_cli("check", good_trace(tmp_path / "good"), "--quiet")
    assert code == 0 and err == ""
    assert out.splitlines()[-1] == "PASS (11 passed, 0 failed, 0 skipped)"
    assert "returns recomputed: td0(γ=1)" in out

    code, out, err = run_cli("check", good_trace(tmp_path / "bad", plant=True), "--quiet")
    assert code == 1
    assert "advantages = masked_whiten(raw advantage)" in out
    assert "§8.2 advantages = masked_whiten(raw advantage): step 2, sample 4, token 6: advantage = " in out
    assert out.splitlines()[-1] == "FAIL: 1 violated (10 passed, 1 failed, 0 skipped)"

    code, out, _ = run_cli("check", str(tmp_path / "bad"), "--json", "--step", "1", "--step", "2")
    report = json.loads(out)
    assert code == 1 and report["steps"] == [1, 2] and report["passed"] is False
    whitening = next(i for i in report["identities"] if i["identity"] == "whitening")
    assert whitening["first_violation"]["location"] == {"step": 2, "sample": 4, "token_index": 6}

    code, _, err = run_cli("check", str(tmp_path / "bad"), "--step", "9")
    assert code == 2 and err == f"verl-ext check: {tmp_path / 'bad'} has no step 9 (steps on disk: 1, 2, 3)\n"


def test_check_of_a_run_whose_estimator_does_not_import_exits_3_unless_allowed(tmp_path, run_cli, monkeypatch):
    """Exit codes: 0 pass, 1 fail, 2 bad input, 3 incomplete; --allow-unchecked makes the incomplete
    check exit 0 and changes nothing in what it reports (the JSON's verdict, what was not checked)."""
    from tests.integration.test_user_estimator import td_half_trace

    monkeypatch.chdir(tmp_path)  # no my_estimators.py here, nor on sys.path
    monkeypatch.setattr(sys, "path", [*sys.path])
    path = td_half_trace(tmp_path / "trace")
    reports = []
    for flags, exit_code in (((), 3), (("--allow-unchecked",), 0)):
        code, out, err = run_cli("check", path, "--quiet", "--json", *flags)
        assert (code, err) == (exit_code, "")
        reports.append(json.loads(out))
    assert reports[0] == reports[1]
    assert reports[0]["verdict"] == "incomplete" and reports[0]["passed"] is False
    assert [entry["identities"] for entry in reports[0]["not_checked"]] == [["advantage_raw", "returns"]]
    assert "my_estimators" in reports[0]["not_checked"][0]["reason"]


def test_progress_lines_on_long_scans(tmp_path):
    stream = io.StringIO()
    check_trace(good_trace(tmp_path / "t"), progress=ProgressPrinter("check", stream, interval=0.0))
    lines = stream.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == ["check: step 1/3", "check: step 2/3", "check: step 3/3"]
    assert "tokens/s" in lines[-1]

    quiet = io.StringIO()
    check_trace(str(tmp_path / "t"), progress=ProgressPrinter("check", quiet, interval=3600))
    assert quiet.getvalue() == ""  # a scan shorter than the interval prints nothing


@pytest.mark.parametrize(
    ("tokens", "rate"), [(1_500, "750 tokens/s"), (50_000, "25.0k tokens/s"), (7_000_000, "3.5M tokens/s")]
)
def test_a_progress_line_says_its_rate_in_a_unit_that_shows_it(monkeypatch, tokens, rate):
    """Tokens over 2 s of a clock the test sets (a scan of small steps once read "0.0M tokens/s")."""
    from types import SimpleNamespace

    from verl_ext.inspect import render

    clock = iter([100.0, 102.0])
    monkeypatch.setattr(render, "time", SimpleNamespace(perf_counter=lambda: next(clock)))  # render's clock only
    stream = io.StringIO()
    ProgressPrinter("summary", stream, interval=0.0)(1, 3, tokens)
    assert stream.getvalue() == f"summary: step 1/3, {tokens:,} tokens, 2.0 s, {rate}\n"


def test_a_second_directory_of_the_same_step_is_refused_not_half_read(trace, run_cli):
    shutil.copytree(trace / "step-3", trace / "step-03")
    for command in ("check", "summary", "show"):
        code, out, err = run_cli(command, str(trace))
        assert code == 2 and out == "", command
        assert err.strip() == (
            f"verl-ext {command}: {trace}/step-03 is not a directory this trace writes: step 3 lives in step-3; "
            "remove or rename the copy"
        )


def test_an_empty_run_path_is_refused(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli("check", "")
    assert code == 2 and err.strip() == "verl-ext check: RUN must be a trace directory or URL, got an empty string"


def test_bad_digits_and_an_unwritable_demo_directory_are_one_line(trace, run_cli, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("show", str(trace), "--digits", "-3")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --digits: must be >= 0, got -3" in err and "Traceback" not in err
    code, _, err = run_cli("demo", "--output-dir", "/proc/x")  # refused by the check before anything starts: its trace dir
    assert code == 2 and err.startswith("verl-ext demo: ") and "/proc/x" in err and "not writable" in err and err.count("\n") == 1


@pytest.mark.parametrize("steps", ["0", "-1", "two"])
def test_demo_refuses_a_step_count_below_one(run_cli, steps, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        run_cli("demo", "--steps", steps, "--output-dir", str(tmp_path))
    assert exit_info.value.code == 2


@pytest.mark.parametrize("command", ["show --format csv", "summary", "check"])
def test_a_reader_that_goes_away_is_not_an_error(trace, command):
    """``verl-ext ... | head -1``: no traceback, and the command's own exit code (0 here), not 1."""
    pipeline = f"{sys.executable} -m verl_ext.cli {command} {trace} | head -1; echo \"status ${{PIPESTATUS[0]}}\""
    result = subprocess.run(["bash", "-c", pipeline], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
    assert result.stdout.splitlines()[-1] == "status 0"

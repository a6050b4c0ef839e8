"""Traces that are not whole (issue 43, "Partial traces said"): a run that did not finish, a step the run
record lists that the disk lacks, a step file cut short. Each command says which steps it could not
read and goes on with the others where that makes sense: ``check`` fails such a step and checks the
rest, ``summary``, ``plot`` and ``view --out`` leave it out and exit 1, ``show`` and ``compare`` fall
back to the last step that reads. A run that did not finish passes ``check`` on the steps it wrote, and
its verdict says how far it got.

The traces are :func:`good_trace`'s three steps of td0 (which pass every identity: 11 passed); the
expected token counts are the sums of the batches' masks, the expected verdicts docs/definitions.md §8.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.inspect.inspect_helpers import good_batches, good_trace
from verl_ext.errors import StepFileError
from verl_ext.check.run import check_trace
from verl_ext.steps.recorded import RecordedRun
from verl_ext.inspect.sql import connect
from verl_ext.inspect.summary import summarize
from verl_ext.inspect.unread import UnreadSteps
from verl_ext.trace.reader import open_trace
from verl_ext.trace.schema import RUN_RECORD, prompt_file, token_file, update_file
from verl_ext.view.page import DATA_ID

VLLM = {"name": "vllm", "version": "0.27.0+cpu", "dtype": "float32"}
#: A run stopped after step 3 of the 40 it planned (the writer's record of a run killed then).
HF = {"name": "hf_generate", "version": "5.10.4", "dtype": "bfloat16"}  # an engine that gives no stop reasons
STOPPED = {"finished": False, "planned_steps": 40, "rollout": HF}
#: The same run, finished: the trainer's fit() returned after its last step.
FINISHED = {"finished": True, "planned_steps": 3, "rollout": HF}
#: good_trace's identities: every one that applies to a td0 run with KL and per-turn rewards passes.
ALL_PASS = "11 passed, 0 failed, 0 skipped"
CUT_SHORT = "is not a readable Parquet file (Parquet magic bytes not found in footer"


def valid_tokens(*steps: int) -> int:
    batches = good_batches()
    return sum(int(batches[step].mask.sum()) for step in steps)


def cut_short(path: Path) -> None:
    """Keep the first half of the file's bytes, as a disk that filled up or a copy interrupted would."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def page_data(html: Path) -> dict:
    text = html.read_text(encoding="utf-8")
    return json.loads(re.search(rf'<script type="application/json" id="{DATA_ID}">(.*?)</script>', text, re.S).group(1))


# --------------------------------------------------------------------------- a run that did not finish


def test_a_run_that_did_not_finish_passes_and_says_how_far_it_got(tmp_path, run_cli):
    path = good_trace(tmp_path / "stopped", run=STOPPED)
    code, out, err = run_cli("check", path, "--quiet")
    assert (code, err) == (0, "")
    assert out.splitlines()[-1] == f"PASS ({ALL_PASS}; 3 of 40 planned steps; the run did not finish)"
    assert out.splitlines()[2:5] == [
        "rollout:   hf_generate 5.10.4, bfloat16",
        "finished:  no: 3 of 40 planned steps",
        f"checked:   3 steps, {valid_tokens(1, 2, 3):,} valid tokens",
    ]
    code, out, _ = run_cli("check", path, "--quiet", "--json")
    assert code == 0 and json.loads(out)["run"] == {"finished": False, "planned_steps": 40, "last_step": 3, "rollout": HF}
    code, out, _ = run_cli("summary", path)
    assert code == 0 and out.startswith("rollout:  hf_generate 5.10.4, bfloat16\nfinished: no: 3 of 40 planned steps\n\nstep ")


def test_a_finished_run_passes_plainly(tmp_path, run_cli):
    code, out, _ = run_cli("check", good_trace(tmp_path / "done", run=FINISHED), "--quiet")
    assert code == 0 and out.splitlines()[-1] == f"PASS ({ALL_PASS})"
    assert "finished:  yes (3 planned steps)" in out.splitlines()


def test_a_failure_of_a_run_that_did_not_finish_says_both(tmp_path, run_cli):
    code, out, _ = run_cli("check", good_trace(tmp_path / "bad", plant=True, run=STOPPED), "--quiet")
    assert code == 1
    assert out.splitlines()[-1] == "FAIL: 1 violated (10 passed, 1 failed, 0 skipped; 3 of 40 planned steps; the run did not finish)"


def test_a_trace_before_format_8_reads_and_says_unknown(tmp_path, run_cli):
    """A run record of format 7 has no finished, planned_steps nor rollout: it reads as before, checks
    as before (a plain PASS), and every command that would say them says they are unknown."""
    path = Path(good_trace(tmp_path / "old", run=FINISHED))
    record = json.loads((path / RUN_RECORD).read_text())
    for key in ("finished", "planned_steps", "rollout"):
        del record[key]
    (path / RUN_RECORD).write_text(json.dumps({**record, "schema_version": 7}))
    trace = open_trace(str(path))
    assert trace.record.schema_version == 7 and (trace.record.finished, trace.record.planned_steps, trace.record.rollout) == (None, None, None)
    code, out, _ = run_cli("check", str(path), "--quiet")
    assert code == 0 and out.splitlines()[-1] == f"PASS ({ALL_PASS})"
    assert out.splitlines()[2:4] == ["rollout:   not recorded (a trace before format 8)", "finished:  unknown (a trace before format 8)"]
    code, out, _ = run_cli("summary", str(path))
    assert code == 0 and out.startswith("rollout:  not recorded (a trace before format 8)\nfinished: unknown (a trace before format 8)\n\n")


@pytest.mark.parametrize(
    ("rollout", "shown"),
    [
        (VLLM, "vllm 0.27.0+cpu, float32"),
        ({"name": "trtllm", "version": None, "dtype": "bfloat16"}, "trtllm (version unknown), bfloat16"),
        ({"name": "hf_generate", "version": "5.10.4", "dtype": None}, "hf_generate 5.10.4"),
    ],
)
def test_the_rollout_engine_is_one_line(tmp_path, rollout, shown):
    trace = open_trace(good_trace(tmp_path / "t", run={**FINISHED, "rollout": rollout}))
    assert RecordedRun.of(trace).describe_rollout() == shown


# --------------------------------------------------------------------------- a step the disk lacks


def test_a_missing_step_fails_check_and_is_said_by_summary_which_exits_1(tmp_path, run_cli):
    path = Path(good_trace(tmp_path / "t", run=FINISHED))
    shutil.rmtree(path / "step-2")
    code, out, _ = run_cli("check", str(path), "--quiet")
    assert code == 1
    assert "  §8.5 every step and update table of the run record is on disk and reads: step 2: step-2/part-0.parquet: listed in the run record, missing on disk" in out
    code, out, err = run_cli("summary", str(path))
    assert code == 1
    assert [line.split()[0] for line in out.split("\n\n")[1].splitlines()[1:]] == ["1", "3"]
    assert err.splitlines()[-1] == "note: step 2 is listed in the run record but missing on disk: left out"
    code, out, err = run_cli("summary", str(path), "--format", "csv")  # the data stays data; what is missing goes to stderr
    assert code == 1 and out.startswith("step,samples,") and "missing on disk" in err


def test_show_without_step_shows_the_last_step_on_disk_and_names_the_later_missing_one(tmp_path, run_cli):
    path = Path(good_trace(tmp_path / "t"))
    shutil.rmtree(path / "step-3")
    code, out, err = run_cli("show", str(path))
    assert code == 0 and out.startswith("step 2 · sample 0 ·")
    assert err.splitlines()[:2] == [
        "note: step 3 is listed in the run record but missing on disk: left out",
        "note: showing step 2, the last step that reads",
    ]


# --------------------------------------------------------------------------- a step file cut short


@pytest.fixture
def cut_trace(tmp_path) -> Path:
    """good_trace with the token file of step 2 cut short."""
    path = Path(good_trace(tmp_path / "t", run=FINISHED))
    cut_short(path / token_file(2))
    return path


def test_check_fails_the_step_cut_short_naming_its_file_and_checks_the_others(cut_trace, run_cli):
    report = check_trace(str(cut_trace))
    assert report.unreadable == (2,) and report.tokens == valid_tokens(1, 3)
    statuses = {r.identity: r.status for r in report.identities}
    assert statuses.pop("steps_on_disk") == "fail" and set(statuses.values()) == {"pass"}
    assert {r.step for r in report.per_step if r.identity == "returns"} == {1, 3}  # every other identity, on the steps that read
    first = report["steps_on_disk"].first
    assert (first.location.step, first.column) == (2, token_file(2)) and first.detail.startswith(CUT_SHORT)
    code, out, err = run_cli("check", str(cut_trace), "--quiet")
    assert (code, err) == (1, "")
    assert f"checked:   2 steps, {valid_tokens(1, 3):,} valid tokens (1 more could not be read)" in out.splitlines()
    assert f"  §8.5 every step and update table of the run record is on disk and reads: step 2: {token_file(2)}: {CUT_SHORT}" in out
    assert out.splitlines()[-1] == "FAIL: 1 violated (10 passed, 1 failed, 0 skipped)"
    code, out, _ = run_cli("check", str(cut_trace), "--quiet", "--json")
    assert code == 1 and json.loads(out)["unreadable_steps"] == [2]


def test_check_fails_a_step_whose_prompt_table_is_cut_short(tmp_path):
    path = Path(good_trace(tmp_path / "t"))
    cut_short(path / prompt_file(3))
    first = check_trace(str(path))["steps_on_disk"].first
    assert (first.location.step, first.column) == (3, prompt_file(3)) and first.detail.startswith(CUT_SHORT)


def test_check_fails_a_step_whose_update_table_is_cut_short(tmp_path):
    from tests.inspect.test_inspect_update import hand_trace

    path = Path(hand_trace(tmp_path / "t"))
    cut_short(path / update_file("actor", 1))
    report = check_trace(str(path))
    first = report["steps_on_disk"].first
    assert report.verdict == "fail" and (first.location.step, first.column) == (1, update_file("actor", 1))


def test_summary_leaves_the_step_cut_short_out_says_why_and_exits_1(cut_trace, run_cli):
    code, out, err = run_cli("summary", str(cut_trace))
    assert code == 1
    assert [line.split()[0] for line in out.split("\n\n")[1].splitlines()[1:]] == ["1", "3"]
    assert err.splitlines()[-1] == f"note: step 2 is left out: {cut_trace}/{token_file(2)} {CUT_SHORT}. Either the file is corrupted or this is not a parquet file.)"
    unread = UnreadSteps.of(open_trace(str(cut_trace)))
    assert summarize(str(cut_trace), unread=unread).column("step").to_pylist() == [1, 3] and list(unread.unreadable) == [2]
    with pytest.raises(StepFileError) as raised:  # from Python, without ``unread``: the step's error, naming it
        summarize(str(cut_trace))
    assert (raised.value.step, raised.value.file) == (2, token_file(2))


def test_show_of_the_step_cut_short_is_one_line_and_exit_2(cut_trace, run_cli):
    code, out, err = run_cli("show", str(cut_trace), "--step", "2")
    assert (code, out) == (2, "")
    assert err == f"verl-ext show: step 2 does not read: {cut_trace}/{token_file(2)} {CUT_SHORT}. Either the file is corrupted or this is not a parquet file.)\n"
    code, out, _ = run_cli("show", str(cut_trace), "--step", "3")  # the others still show
    assert code == 0 and out.startswith("step 3 · sample 0 ·")


def test_show_and_compare_without_step_fall_back_to_the_last_step_that_reads(tmp_path, run_cli):
    path = Path(good_trace(tmp_path / "t"))
    cut_short(path / token_file(3))
    for command, first_line in (("show", "step 2 · sample 0 ·"), ("compare", "step 2, sample 0: raw advantages")):
        code, out, err = run_cli(command, str(path))
        assert code == 0 and out.startswith(first_line), command
        assert err.splitlines()[:2] == [
            f"note: step 3 is left out: {path}/{token_file(3)} {CUT_SHORT}. Either the file is corrupted or this is not a parquet file.)",
            "note: showing step 2, the last step that reads",
        ], command


def test_plot_draws_the_steps_that_read_and_exits_1(cut_trace, run_cli, tmp_path):
    code, out, err = run_cli("plot", str(cut_trace), "--out", str(tmp_path / "plots"), "--quiet")
    assert code == 1
    assert {Path(line).name for line in out.splitlines()} >= {"over_steps.png", "positions_step3.png", "critic_ev.png"}
    assert f"note: step 2 is left out: {cut_trace}/{token_file(2)} {CUT_SHORT}" in err
    code, _, err = run_cli("plot", str(cut_trace), "--out", str(tmp_path / "step2"), "--step", "2", "--quiet")
    assert code == 2 and err.startswith("verl-ext plot: step 2 does not read: ") and err.count("\n") == 1


def test_sql_leaves_the_step_cut_short_out_of_its_views_says_why_and_exits_1(cut_trace, run_cli):
    """As summary: the other steps answer, one note names the file, exit 1; also for a query of
    another step, which does not need the file but whose views lack a step of the run."""
    note = f"note: step 2 is left out: {cut_trace}/{token_file(2)} {CUT_SHORT}. Either the file is corrupted or this is not a parquet file.)\n"
    code, out, err = run_cli("sql", str(cut_trace), "SELECT step, count(*) FILTER (WHERE mask) AS valid FROM tokens GROUP BY step ORDER BY step", "--format", "csv")
    assert (code, out, err) == (1, f"step,valid\n1,{valid_tokens(1)}\n3,{valid_tokens(3)}\n", note)
    code, out, err = run_cli("sql", str(cut_trace), "SELECT count(*) AS valid FROM tokens WHERE mask AND step = 3", "--format", "csv")
    assert (code, out, err) == (1, f"valid\n{valid_tokens(3)}\n", note)
    unread = UnreadSteps.of(open_trace(str(cut_trace)))
    assert connect(str(cut_trace), unread=unread).execute("SELECT DISTINCT step FROM prompts ORDER BY step").fetchall() == [(1,), (3,)]
    assert list(unread.unreadable) == [2]
    with pytest.raises(StepFileError) as raised:  # from Python, without ``unread``: the step's error, naming it
        connect(str(cut_trace))
    assert (raised.value.step, raised.value.file) == (2, token_file(2))


def test_sql_leaves_out_a_step_whose_prompt_table_is_cut_short_or_missing_on_disk(tmp_path, run_cli):
    path = Path(good_trace(tmp_path / "t", run=FINISHED))
    cut_short(path / prompt_file(3))
    shutil.rmtree(path / "step-2")
    code, out, err = run_cli("sql", str(path), "SELECT DISTINCT step FROM tokens ORDER BY step", "--format", "csv")
    assert (code, out) == (1, "step\n1\n")
    assert err.splitlines() == [
        "note: step 2 is listed in the run record but missing on disk: left out",
        f"note: step 3 is left out: {path}/{prompt_file(3)} {CUT_SHORT}. Either the file is corrupted or this is not a parquet file.)",
    ]


def test_the_page_holds_the_steps_that_read_and_says_which_it_left_out(cut_trace, run_cli, tmp_path):
    page = tmp_path / "run.html"
    code, out, err = run_cli("view", str(cut_trace), "--out", str(page), "--quiet")
    assert code == 1 and out.strip() == str(page)
    data = page_data(page)
    assert data["steps_in_file"] == [1, 3] and set(data["steps"]) == {"1", "3"}
    left_out = f"step 2 is left out: {cut_trace}/{token_file(2)} {CUT_SHORT}. Either the file is corrupted or this is not a parquet file.)"
    assert data["run"]["notes"] == [left_out] and f"note: {left_out}" in err.splitlines()
    assert data["run"]["rollout"] == "hf_generate 5.10.4, bfloat16" and data["run"]["finished"] is True
    code, _, err = run_cli("view", str(cut_trace), "--out", str(page), "--step", "2", "--quiet")
    assert code == 2 and err.startswith("verl-ext view: step 2 does not read: ") and err.count("\n") == 1


def test_the_page_of_a_run_that_did_not_finish_says_so(tmp_path, run_cli):
    page = tmp_path / "run.html"
    code, _, _ = run_cli("view", good_trace(tmp_path / "t", run=STOPPED), "--out", str(page), "--quiet")
    assert code == 0 and page_data(page)["run"]["notes"] == ["the run did not finish: 3 of 40 planned steps"]

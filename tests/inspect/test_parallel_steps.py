"""Steps in parallel (verl_ext.trace.parallel): ``check``, ``summary``, ``summary --critic``, ``plot`` and ``view --out`` in worker
processes give the report and the rows of one process, byte for byte, on a trace with a planted NaN, a
nudged return, an update table and a step whose file does not read; Ctrl-C leaves no worker behind.

Covers: verl_ext.trace.parallel, verl_ext.check.run.check_trace, verl_ext.inspect.summary.summarize,
verl_ext.inspect.critic.critic_diagnostics, verl_ext.inspect.plots.save_plots, the CLI's --jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.forkserver import real_python
from tests.view.view_helpers import save_piece_tokenizer, write_view_trace
from verl_ext.trace import parallel

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    """Five steps: a NaN value (step 2), a return nudged by 1% (step 4), step 5's token file cut short."""
    directory = tmp_path_factory.mktemp("parallel")
    path = write_view_trace(directory / "trace", save_piece_tokenizer(directory / "tok"), steps=(1, 2, 3, 4, 5), nudged=(4, 1, 3))
    token_file = Path(path) / "step-5" / "part-0.parquet"
    token_file.write_bytes(token_file.read_bytes()[:200])
    return path


@pytest.fixture
def every_trace_in_parallel(monkeypatch):
    monkeypatch.setattr(parallel, "MIN_PARALLEL_ROWS", 0)  # these traces are small


def test_the_check_in_two_processes_is_the_check_in_one(trace, every_trace_in_parallel):
    from verl_ext.check.run import check_trace
    from verl_ext.inspect.render import format_report

    seen = []
    serial, in_two = check_trace(trace), check_trace(trace, jobs=2, progress=lambda *counts: seen.append(counts))
    assert serial.verdict == "fail" and serial.unreadable == (5,)  # the trace has something to find
    assert {r.identity for r in serial.identities if r.status == "fail"} >= {"returns", "finite", "steps_on_disk"}
    assert json.dumps(in_two.to_dict()) == json.dumps(serial.to_dict())
    assert format_report(in_two) == format_report(serial)
    assert in_two.to_arrow().to_pandas().equals(serial.to_arrow().to_pandas())  # NaN where NaN
    # the progress counts every step and, at the end, every valid token
    assert [done for done, _, _ in seen] == [1, 2, 3, 4, 5] and {total for _, total, _ in seen} == {5}
    assert seen[-1][2] == in_two.tokens > 0


def test_the_summary_in_two_processes_is_the_summary_in_one(trace, every_trace_in_parallel):
    from verl_ext.inspect.summary import summarize
    from verl_ext.inspect.unread import UnreadSteps

    serial_unread, parallel_unread = UnreadSteps(), UnreadSteps()
    serial = summarize(trace, unread=serial_unread)
    assert serial.num_rows == 4 and list(serial_unread.unreadable) == [5]
    assert summarize(trace, unread=parallel_unread, jobs=2).to_pandas().equals(serial.to_pandas())  # NaN where NaN
    assert parallel_unread == serial_unread


def test_the_critic_by_position_in_two_processes_is_the_one_in_one(trace, every_trace_in_parallel):
    from verl_ext.inspect.critic import critic_diagnostics
    from verl_ext.inspect.unread import UnreadSteps

    serial_unread, parallel_unread = UnreadSteps(), UnreadSteps()
    serial = critic_diagnostics(trace, unread=serial_unread)
    assert serial.num_rows > 0 and list(serial_unread.unreadable) == [5]
    assert critic_diagnostics(trace, unread=parallel_unread, jobs=2).to_pandas().equals(serial.to_pandas())  # NaN where NaN
    assert parallel_unread == serial_unread


def job_count_spy(asked: list):
    """A wrapper factory: the wrapped function records (its name, jobs, ray_address) in ``asked`` and
    runs in this process (its parallel results are tested above)."""

    def spy(original):
        def serially(*args, jobs=1, ray_address=None, **kwargs):
            asked.append((original.__name__, jobs, ray_address))
            return original(*args, **kwargs)

        return serially

    return spy


def test_plot_reads_the_steps_in_as_many_processes_as_asked(trace, tmp_path, monkeypatch, capsys):
    """``plot --jobs 2``: the figures over the steps hand it to the summary and the critic
    diagnostics, whose parallel rows equal the serial ones (the tests above). Each is called here in
    one process, to keep the test short."""
    from verl_ext.cli import main
    from verl_ext.inspect import plots

    asked = []
    spy = job_count_spy(asked)
    monkeypatch.setattr(plots, "summarize", spy(plots.summarize))
    monkeypatch.setattr(plots, "critic_diagnostics", spy(plots.critic_diagnostics))
    assert main(["plot", trace, "--out", str(tmp_path), "--jobs", "2", "--quiet"]) == 1  # step 5 is left out, and said
    assert sorted(asked) == [("critic_diagnostics", 2, None), ("summarize", 2, None)]
    assert "over_steps.png" in {path.name for path in tmp_path.iterdir()} and "step 5" in capsys.readouterr().err


def test_the_view_page_reads_its_steps_in_as_many_processes_as_asked(trace, tmp_path, monkeypatch, capsys):
    """``view --out --jobs 2``: the page's summary and check are handed the job count (their parallel
    results equal the serial ones: the tests above); ``--ray`` without ``--out`` is one line."""
    from verl_ext.check import run as check_run
    from verl_ext.cli import main
    from verl_ext.inspect import summary

    asked = []
    spy = job_count_spy(asked)
    monkeypatch.setattr(summary, "summarize", spy(summary.summarize))
    monkeypatch.setattr(check_run, "check_trace", spy(check_run.check_trace))
    assert main(["view", trace, "--out", str(tmp_path / "page.html"), "--jobs", "2", "--quiet"]) == 1  # step 5 is left out
    assert sorted(asked) == [("check_trace", 2, None), ("summarize", 2, None)] and (tmp_path / "page.html").is_file()
    capsys.readouterr()
    assert main(["view", trace, "--ray", "127.0.0.1:1"]) == 2 and "--ray reads the steps of a file's page" in capsys.readouterr().err


def test_a_small_trace_stays_in_one_process(trace, monkeypatch):
    """Below MIN_PARALLEL_ROWS no worker starts (they would cost more than the steps)."""
    monkeypatch.setattr(parallel, "_in_processes", lambda *args: pytest.fail("a pool was started"))
    from verl_ext.check.run import check_trace

    assert check_trace(trace, jobs=2).unreadable == (5,)


def test_a_bad_job_count_is_one_line(trace, run_cli, capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse's one line
        run_cli("check", trace, "--jobs", "0")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "argument --jobs: must be >= 1, got 0" in err and "Traceback" not in err


def test_no_ray_cluster_at_the_address_is_one_line(trace, run_cli):
    code, _, err = run_cli("check", trace, "--ray", "127.0.0.1:1")
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1
    assert err.startswith("verl-ext check: --ray: no Ray cluster at 127.0.0.1:1 (")


INTERRUPTED = """
import sys, time
from verl_ext import cli
from verl_ext.trace import parallel
parallel.MIN_PARALLEL_ROWS = 0
sys.exit(cli.main(["check", sys.argv[1], "--jobs", "2"]))
"""


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def test_ctrl_c_stops_every_worker_and_says_so_in_one_line(trace, tmp_path):
    """SIGINT to the command's process group, as a terminal sends it, once its workers run: exit 130,
    one line, no traceback, and no process of it left."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = subprocess.Popen(  # a real interpreter, whose processes are its own children
        [real_python(), "-c", INTERRUPTED, trace], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    # the workers are up, and the command no longer ignores Ctrl-C as it does while it starts them
    while (len(_workers(command.pid)) < 2 or _ignores_interrupts(command.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = _descendants(command.pid)
    assert len(_workers(command.pid)) == 2, "the pool's two workers did not start"
    os.killpg(command.pid, signal.SIGINT)
    out, err = command.communicate(timeout=60)
    assert command.returncode == 130, err
    assert err.strip().splitlines()[-1] == "verl-ext check: interrupted" and "Traceback" not in err
    deadline = time.monotonic() + 10
    while [pid for pid in started if Path(f"/proc/{pid}").exists()] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in started if Path(f"/proc/{pid}").exists()], "a process of the command is left"


def test_workers_end_with_a_parent_killed_outright(trace):
    """SIGKILL to the command alone once its workers run (the out-of-memory killer's way): no Ctrl-C
    reaches them and the parent cannot stop them, yet none is left (Linux: PR_SET_PDEATHSIG)."""
    command = subprocess.Popen(
        [real_python(), "-c", INTERRUPTED, trace], env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while len(_workers(command.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    started = _descendants(command.pid)
    assert len(_workers(command.pid)) == 2, "the two workers did not start"
    command.kill()
    assert command.wait(timeout=60) == -signal.SIGKILL  # killed while its workers ran, not done before
    deadline = time.monotonic() + 10
    while [pid for pid in started if Path(f"/proc/{pid}").exists()] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in started if Path(f"/proc/{pid}").exists()], "a worker outlived its parent"


def _ignores_interrupts(pid: int) -> bool:
    """Whether ``pid`` ignores SIGINT (its SigIgn mask in /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
    return False


def _workers(pid: int) -> set[int]:
    """The pool's worker processes below ``pid`` (multiprocessing's spawned interpreters)."""
    workers = set()
    for child in _descendants(pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                workers.add(child)
        except OSError:
            pass
    return workers


def _killed_at_step_3(trace, step: int) -> tuple[None, int]:
    """A worker's step as the kernel's out-of-memory killer ends it, at step 3."""
    if step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return None, 1


def test_a_worker_that_dies_is_one_error_not_a_wait(trace, every_trace_in_parallel):
    """A worker killed in its step: map_steps raises WorkerLost (a usage error: one line from the CLI)
    within seconds, rather than waiting for the step."""
    from verl_ext.errors import UsageError, WorkerLost
    from verl_ext.trace.reader import open_trace

    def waited(*_):
        raise AssertionError("no answer in 60 s: the parent waits for the dead worker's step")

    previous = signal.signal(signal.SIGALRM, waited)
    signal.alarm(60)
    try:
        with pytest.raises(WorkerLost, match="a worker process ended before returning its step") as raised:
            list(parallel.map_steps(open_trace(trace), [1, 2, 3, 4, 5], _killed_at_step_3, jobs=2))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert isinstance(raised.value, UsageError)


UNGUARDED_SCRIPT = """
from verl_ext.trace import parallel
from verl_ext.trace.reader import open_trace
parallel.MIN_PARALLEL_ROWS = 0

def tokens(trace, step):
    return None, 0

print(list(parallel.map_steps(open_trace(TRACE), [1, 2, 3], tokens, jobs=2)))
"""


def test_a_script_without_a_main_guard_is_told_so(trace, tmp_path):
    """Steps in two processes from a script's top level (check_trace(jobs=2) and the others go through
    map_steps): each spawned worker imports the script and cannot start workers of its own; the script
    ends with WorkerLost naming the guard, not a hang."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT.replace("TRACE", repr(trace)))
    done = subprocess.run(
        [real_python(), str(script)], env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith("verl_ext.errors.WorkerLost: ")
    assert 'if __name__ == "__main__":' in done.stderr


def test_a_trace_being_written_is_checked_on_whole_steps(tmp_path, every_trace_in_parallel):
    """While a writer adds steps (and their update tables), checks in two processes see whole steps
    only: every step they list passes, none is unreadable, and the run reads as not finished."""
    import threading

    from verl_ext.check.run import check_trace
    from verl_ext.trace.reader import open_trace

    tokenizer = save_piece_tokenizer(tmp_path / "tok")
    writing = threading.Thread(target=write_view_trace, args=(tmp_path / "trace", tokenizer), kwargs={"steps": range(1, 41), "planted": False})
    writing.start()
    reports = []
    try:
        while writing.is_alive() and len(reports) < 2:
            if (tmp_path / "trace" / "_run.json").exists() and open_trace(str(tmp_path / "trace")).steps:
                reports.append(check_trace(str(tmp_path / "trace"), jobs=2))
            time.sleep(0.05)
    finally:
        writing.join()
    assert reports, "the writer finished before a check could start"
    for report in reports:
        assert report.unreadable == () and report.verdict == "pass", [str(r.first) for r in report.identities if r.first]
    assert open_trace(str(tmp_path / "trace")).steps == list(range(1, 41))

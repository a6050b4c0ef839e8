"""Runs that collide or stop early (issue 43), by fault injection: verl's real trainer (in process, the
learning recipe) under the runner every command uses (``python -m verl_ext.apps.progress --lock``, as
recipes/cpu_demo.sh runs verl's main_ppo), interrupted by SIGINT and SIGTERM at points drawn by a
seeded generator (during a step, or before the first), while a second run tries the same folder.

Each time: one line says where the run stopped and nothing follows it; exit 130; every step that
finished is in the trace, whose check passes and says the run did not finish; metrics.jsonl and
train.log hold every finished step; no temporary file, stop file or trace lease is left; no process of
the run is left. The second run is refused in one line, exit 2, and the first loses nothing.

Covers: verl_ext.apps.progress (run_trainer, forwarding_signals), verl_ext.apps.output_lock,
verl_ext.stopping and its check in verl_ext.integration.step, verl_ext.apps.learning's stop."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: The steps a run plans, far more than it reaches before it is interrupted: on a fast machine a run of
#: 5 small steps had finished all of them while the second run was being refused (its last step came
#: before the signal). Every run is interrupted, so the steps it never reaches cost nothing.
STEPS = 30
#: The interruptions come after one of the first INTERRUPT_WITHIN steps (drawn), or before the first.
INTERRUPT_WITHIN = 3
#: The draw of the interruption points: the same every run of the suite (issue 43: "at random points").
SEED = 43
#: Small steps (4 prompts, 1 response each) and no validation: what is tested is where a run stops.
SMALL = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=1", "trainer.val_before_train=False"]
_STEP_LINE = "step:{} - "


def start(out: Path, cpu_env) -> subprocess.Popen:
    """The runner with the learning recipe in ``out`` (a session of its own: signals go to it alone)."""
    out.mkdir(parents=True, exist_ok=True)
    trainer = [
        sys.executable, "-m", "verl_ext.apps.learning", str(out), "--steps", str(STEPS), "--test-freq", str(STEPS), "--trace", "--", *SMALL,
    ]  # fmt: skip
    command = [
        sys.executable, "-m", "verl_ext.apps.progress", str(out / "train.log"), "--steps", str(STEPS), "--lock", str(out),
        "--label", "run", "--holder", "the fault-injection test", "--", *trainer,
    ]  # fmt: skip
    return subprocess.Popen(command, env=cpu_env(out), cwd=out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


#: verl's line once its workers are up, before the first step
_STARTED = "Training from scratch"


def wait_for(out: Path, marker: str, runner: subprocess.Popen, timeout: float = 300) -> None:
    """Until ``marker`` is in train.log."""
    deadline = time.monotonic() + timeout
    log = out / "train.log"
    while time.monotonic() < deadline:
        if log.exists() and marker in log.read_text(errors="replace"):
            return
        assert runner.poll() is None, f"the run ended before {marker!r}: {runner.stdout.read()[-3000:]}"
        time.sleep(0.1)
    pytest.fail(f"no {marker!r} in train.log in {timeout} s")


def trainer_pids(runner: subprocess.Popen) -> list[int]:
    """The processes of the runner's session (the runner, the trainer it started, the trainer's own)."""
    sid = os.getsid(runner.pid)
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
            except ProcessLookupError:
                pass
    return pids


def assert_stopped_whole(out: Path, runner: subprocess.Popen, signum: int, pids: list[int]) -> int:
    """What every interruption must leave; returns the last step written."""
    from verl_ext.check.run import check_trace
    from verl_ext.trace.reader import open_trace

    printed = runner.stdout.read()
    assert runner.wait(timeout=120) == 130
    lines = [line for line in printed.splitlines() if line.strip()]
    assert lines[-1].startswith(f"[run] stopped by {signal.Signals(signum).name} ")  # the one line, and nothing after it
    assert "Traceback" not in printed
    for pid in pids:  # nothing of the run is left (a zombie would still be a process of its own)
        assert not Path(f"/proc/{pid}").exists(), f"process {pid} of the run is left"
    assert not (out / ".verl-ext.stop").exists()
    metrics_file = out / "metrics.jsonl"
    metrics = [json.loads(line)["step"] for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    trace_dir = out / "trace"
    assert not (trace_dir / "_tmp").exists() and not (trace_dir / "_writer.json").exists()
    written = open_trace(str(trace_dir)).steps if (trace_dir / "_run.json").exists() else []
    last = written[-1] if written else 0
    assert (f"after step {last} of {STEPS}" if last else "before its first step") in lines[-1]
    assert metrics == list(range(1, last + 1))  # every step written, and no other
    log = (out / "train.log").read_text()
    assert all(_STEP_LINE.format(step) in log for step in metrics)
    if written:
        assert written == list(range(1, last + 1)) and last < STEPS
        report = check_trace(str(trace_dir))
        assert report.passed and report.run.finished is False and report.run.planned_steps == STEPS
    return last


def test_interrupted_at_drawn_points_every_finished_step_is_kept_whole_and_a_second_run_is_refused(tmp_path, cpu_env, assets):
    draw = random.Random(SEED)
    interruptions = [
        (signal.SIGINT, draw.randint(1, INTERRUPT_WITHIN)),  # after a step: during the next one
        (signal.SIGTERM, draw.randint(1, INTERRUPT_WITHIN)),
        (signal.SIGINT, 0),  # before the first step: no step is written
    ]
    for index, (signum, after_step) in enumerate(interruptions):
        out = tmp_path / f"run{index}"
        runner = start(out, cpu_env)
        wait_for(out, _STEP_LINE.format(after_step) if after_step else _STARTED, runner)
        if index == 0:  # a second run into the same folder, while the first trains
            second = subprocess.run(
                [sys.executable, "-m", "verl_ext.apps.learning", str(out), "--steps", "1"],
                env=cpu_env(out), cwd=tmp_path, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert second.returncode == 2
            (line,) = second.stderr.strip().splitlines()
            assert f"{out} is in use by `the fault-injection test` (process " in line
        if after_step:
            time.sleep(draw.uniform(0.0, 1.0))  # somewhere inside the next step
        pids = trainer_pids(runner)
        os.kill(runner.pid, signum)
        last = assert_stopped_whole(out, runner, signum, pids)
        assert last >= after_step and (last == 0 or after_step > 0)

"""Issue 59, item 5: a run into a folder that holds an earlier run keeps the earlier one, moved to
``earlier/<UTC time>/`` with whatever the user put inside its outputs, says so in one line, and deletes
nothing; ``make demo`` twice still works. The demo (through the CLI, its trainer stubbed: nothing trains),
the study's runs, recipes/cpu_demo.sh's runner (``verl_ext.apps.progress --lock``) and the function they
share; a Ctrl-C during the move is acted on once the move is whole.

Covers: verl_ext.apps.output_lock.keep_earlier_run, verl_ext.apps.demo, verl_ext.apps.study._run_one,
verl_ext.apps.progress.main."""

from __future__ import annotations

import calendar
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

STAMP = re.compile(r"^(\d{8}T\d{6}Z)(-\d+)?$")


def plant(folder: Path, names: dict[str, str]) -> None:
    """Files (path relative to ``folder`` -> text)."""
    for name, text in names.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def contents(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): path.read_text() for path in sorted(folder.rglob("*")) if path.is_file()}


def only_earlier(folder: Path) -> Path:
    (kept,) = (folder / "earlier").iterdir()
    return kept


def test_the_earlier_outputs_are_moved_whole_and_the_rest_stays(tmp_path, capsys):
    from verl_ext.apps.output_lock import keep_earlier_run

    earlier = {"trace/step-1/part-0.parquet": "a step", "trace/my_notes.txt": "the user's", "plots/a.png": "png", "train.log": "log"}
    plant(tmp_path, {**earlier, "mine.txt": "the user's, beside the outputs", ".verl-ext.lock": "{}"})
    before = time.time()
    kept = keep_earlier_run(tmp_path, ("trace", "plots", "view.html", "train.log"), "[demo]")
    assert kept.parent == tmp_path / "earlier" and contents(kept) == earlier
    stamp = STAMP.match(kept.name).group(1)  # its UTC time, when it was moved
    assert int(before) - 1 <= calendar.timegm(time.strptime(stamp, "%Y%m%dT%H%M%SZ")) <= time.time() + 1
    assert contents(tmp_path) == {"mine.txt": "the user's, beside the outputs", ".verl-ext.lock": "{}", **{f"earlier/{kept.name}/{k}": v for k, v in earlier.items()}}
    assert capsys.readouterr().out == f"[demo] the earlier run in this folder (trace/, plots/, train.log) moved to {kept}\n"
    # again at once: a folder of its own; with nothing to keep, none
    plant(tmp_path, {"train.log": "second"})
    again = keep_earlier_run(tmp_path, ("trace", "train.log"), "[demo]")
    assert again != kept and again.parent == kept.parent and contents(again) == {"train.log": "second"}
    assert keep_earlier_run(tmp_path, ("trace", "train.log"), "[demo]") is None
    assert len(list((tmp_path / "earlier").iterdir())) == 2


def test_a_ctrl_c_during_the_move_comes_after_it(tmp_path, monkeypatch):
    """SIGINT arrives between the first and the second rename: every output is moved, then KeyboardInterrupt."""
    from verl_ext.apps import output_lock

    plant(tmp_path, {"trace/x": "1", "metrics.jsonl": "2", "train.log": "3"})
    rename = os.rename

    def interrupted(source, target):
        rename(source, target)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(output_lock.os, "rename", interrupted)
    with pytest.raises(KeyboardInterrupt):
        output_lock.keep_earlier_run(tmp_path, ("trace", "metrics.jsonl", "train.log"), "[demo]")
    assert contents(only_earlier(tmp_path)) == {"trace/x": "1", "metrics.jsonl": "2", "train.log": "3"}
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_move_that_cannot_be_done_is_one_line_and_loses_nothing(tmp_path):
    from verl_ext.apps.output_lock import keep_earlier_run
    from verl_ext.errors import UsageError

    plant(tmp_path, {"trace/x": "1", "earlier": "a file of the user's, where the earlier runs would go"})
    with pytest.raises(UsageError, match=f"^cannot move the earlier run in {tmp_path} aside: "):
        keep_earlier_run(tmp_path, ("trace",), "[demo]")
    assert contents(tmp_path) == {"trace/x": "1", "earlier": "a file of the user's, where the earlier runs would go"}


def test_a_demo_run_again_keeps_the_earlier_run(run_cli, assets, tmp_path, monkeypatch):
    """The demo deleted the earlier trace/ and plots/ (a file of the user's in trace/ with them) and wrote
    over view.html, train.log and metrics.jsonl. Its trainer stubbed here (it fails at once): what is
    tested is what the demo does to the folder before it trains."""
    from verl_ext.apps import demo

    out = tmp_path / "demo"
    earlier = {"trace/step-1/part-0.parquet": "a step", "trace/mine.txt": "the user's", "plots/value.png": "png", "view.html": "<html>",
               "train.log": "verl's output", "metrics.jsonl": "{}\n"}  # fmt: skip
    plant(out, {**earlier, "notes.txt": "the user's, beside the outputs"})
    monkeypatch.setattr(demo, "_train", lambda args, output, before, lock: (1, None))
    code, stdout, _ = run_cli("demo", "--output-dir", str(out), "--steps", "2")
    assert code == 1
    kept = only_earlier(out)
    assert contents(kept) == earlier
    assert {path.name for path in out.iterdir()} == {"earlier", "notes.txt", ".verl-ext.lock"}
    assert f"[demo] the earlier run in this folder (trace/, metrics.jsonl, train.log, plots/, view.html) moved to {kept}\n" in stdout


def test_a_study_run_trained_again_keeps_its_earlier_attempt(assets, tmp_path):
    """A run of the study trained again (other settings, or it failed or stopped) had its run.json removed
    and its train.log and metrics.jsonl written over, and its trace merged with the new one's steps."""
    from verl_ext.apps import study

    run_dir = tmp_path / "runs" / "mc-seed0"
    earlier = {"run.json": '{"steps": 40}', "train.log": "log", "metrics.jsonl": "{}\n", "trace/step-40/part-0.parquet": "step 40"}
    plant(run_dir, earlier)

    class Stopped:  # the study was stopped before this run started
        signal = None

        def run(self, command, directory, log):
            return None

    settings = study.StudySettings(steps=2, test_freq=2, threshold=0.8)
    assert study._run_one("mc", "pretrained", 0, settings, run_dir, Stopped()) is None
    assert contents(only_earlier(run_dir)) == earlier


def test_the_recipes_runner_keeps_the_earlier_log_and_metrics(tmp_path, capsys):
    """recipes/cpu_demo.sh's runner removed the earlier metrics.jsonl and wrote over train.log; the
    checkpoints stay, for verl to resume from."""
    from verl_ext.apps import progress

    plant(tmp_path, {"train.log": "the earlier run's", "metrics.jsonl": "{}\n", "checkpoints/latest_checkpointed_iteration.txt": "5"})
    status = progress.main([str(tmp_path / "train.log"), "--lock", str(tmp_path), "--label", "cpu-demo", "--",
                            sys.executable, "-c", "print('step:1 - critic/score/mean:1.0')"])  # fmt: skip
    assert status == 0
    kept = only_earlier(tmp_path)
    assert contents(kept) == {"train.log": "the earlier run's", "metrics.jsonl": "{}\n"}
    assert (tmp_path / "train.log").read_text() == "step:1 - critic/score/mean:1.0\n"
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "5"
    assert f"[cpu-demo] the earlier run in this folder (metrics.jsonl, train.log) moved to {kept}\n" in capsys.readouterr().out

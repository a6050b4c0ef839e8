"""Readable progress for a CPU run: keep verl's full output in a log, print one line per event.

verl prints every metric of a step on one very long line; on a terminal the phases of a run (Ray
start, workers, validation, steps) drown in it. ``recipes/cpu_demo.sh`` pipes the trainer through::

    python -m verl_ext.apps.progress LOG_FILE --steps N [--rollout vllm] [--lock DIR] -- python -m verl.trainer.main_ppo ...

which runs the trainer, writes everything it prints to LOG_FILE and prints: the startup phases (the
rollout's server named), one line per training step with its main metrics (verl-ext's ``ev_mc_last``
and ``top_token_share`` among them), validation scores, and any traceback in full. Ctrl-C or SIGTERM
stops the trainer between two steps (:mod:`verl_ext.stopping`: the run's stop file), and one line
says where it stopped. With ``--lock DIR`` the folder's lock (:mod:`verl_ext.apps.output_lock`) is
taken first, and an earlier run's ``metrics.jsonl`` and log in DIR moved to ``DIR/earlier/<UTC time>/``
(its checkpoints stay, for verl to resume from). Without a command it follows its
standard input. From Python: :func:`run_trainer`, :func:`follow`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, TextIO

_STEP = re.compile(r"step:(\d+) - (.*)")
_METRIC = re.compile(r"([\w/@.\-]+):(?:np\.\w+\()?(-?[\d.]+(?:e-?\d+)?)")
#: verl's name of a rollout -> what the progress lines call its server.
ROLLOUT_LABELS = {"hf_generate": "HF-generate", "vllm": "vLLM", "sglang": "SGLang"}
_PHASES = {
    "Started a local Ray instance": "Ray started",
    "(TaskRunner pid=": "task runner up (legacy RayPPOTrainer)",
    "(OneStepTaskRunner pid=": "task runner up (one-step-off-policy OneStepOffRayTrainer)",
    "[ASYNC MAIN] TaskRunner hostname": "task runner up (fully-async FullyAsyncTrainer and FullyAsyncRollouter)",
    "TaskRunnerV1 pid": "task runner up (V1 PPOTrainer)",
    "(vLLMHttpServer pid=": "vLLM server starting (its engine loads in a process of its own)",
    "LLMServerManager:": "{rollout} rollout server up",
    "Training from scratch": "workers ready; validating before training",
    "Resuming from": "resuming from a checkpoint",
}
_SHOWN = {  # metric -> label, in display order
    "critic/score/mean": "score",
    "critic/rewards/mean": "reward",
    "critic/values/mean": "value",
    "critic/vf_loss": "vf_loss",
    "actor/pg_loss": "pg_loss",
    # verl-ext's live metrics (docs/definitions.md §9): is the critic right at the outcome, and how
    # much of a response's credit sits on its single largest token
    "verl_ext/critic/ev_mc_last": "ev_mc_last",
    "verl_ext/credit/top_token_share": "top_token_share",
    "timing_s/step": "step_s",
}


def summarize_step(step: int, metrics: dict[str, float], total: int | None) -> str | None:
    """One line for a step's metrics, or None if the line holds none worth showing."""
    # verl's val-core/<data_source>/<metric>/mean@<n> (its best@n / worst@n bootstraps are left out)
    validation = {k: v for k, v in metrics.items() if k.startswith("val-core/") and k.split("/")[-1].startswith("mean@")}
    shown = [f"{label} {metrics[key]:.4g}" for key, label in _SHOWN.items() if key in metrics]
    shown += [f"val {key.split('/')[-2]} {value:.3f}" for key, value in validation.items()]
    if not shown:
        return None
    where = f"step {step}/{total}" if total else f"step {step}"
    return f"[{where}] " + "  ".join(shown)


def follow(
    lines: Iterable[str],
    log_file: str | os.PathLike,
    steps: int | None = None,
    out: TextIO = sys.stdout,
    every: int = 1,
    rollout: str = "hf_generate",
    quiet: Callable[[], bool] = lambda: False,
):
    """Copy ``lines`` (a trainer's output) to ``log_file``; print the progress lines to ``out``:
    the step lines of every ``every``-th step, the first and last step and validation steps.
    ``rollout``: verl's name of the run's rollout, which the progress lines name. While ``quiet()``
    (a run asked to stop), a traceback goes to the log only. Returns the last step verl reported
    (None before the first)."""
    started, in_traceback, seen_phases, last_step = time.monotonic(), False, set(), None
    label = ROLLOUT_LABELS.get(rollout, rollout)
    with open(log_file, "w") as log:
        for line in lines:
            log.write(line)
            log.flush()
            elapsed = f"{time.monotonic() - started:6.1f}s"
            if "Traceback (most recent call last)" in line:
                in_traceback = True
            if in_traceback:
                if not quiet():
                    print(line, end="", file=out, flush=True)
                continue
            for marker, phase in _PHASES.items():
                phase = phase.format(rollout=label)
                if marker in line and phase not in seen_phases:
                    seen_phases.add(phase)
                    print(f"{elapsed}  {phase}", file=out, flush=True)
            match = _STEP.search(line)
            if match:
                step = last_step = int(match.group(1))
                metrics = {key: float(value) for key, value in _METRIC.findall(match.group(2))}
                shown = step % every == 0 or step in (1, steps) or any(k.startswith("val-core/") for k in metrics)
                summary = summarize_step(step, metrics, steps) if shown else None
                if summary:
                    print(f"{elapsed}  {summary}", file=out, flush=True)
    return last_step


def start_trainer(command: list[str], **popen) -> subprocess.Popen:
    """Start ``command`` with its output in a pipe, in a session of its own: a terminal's Ctrl-C reaches
    it only through :func:`forwarding_signals` (once, not once per process of its group)."""
    return subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True, **popen
    )  # fmt: skip


@contextlib.contextmanager
def forwarding_signals(process: subprocess.Popen, stop_file: str | os.PathLike) -> Iterator[list[int]]:
    """For the block: the first SIGINT or SIGTERM to this process creates the run's ``stop_file``
    (:mod:`verl_ext.stopping`: the run stops before its next step), a second reaches ``process`` as
    SIGINT (it stops at once), a third kills it. Yields the signals received. Leaving the block by an
    exception kills the process; a stop file of an earlier run is removed first, this run's after."""
    received: list[int] = []
    stop_file = Path(stop_file)
    stop_file.unlink(missing_ok=True)

    def forward(signum, frame):
        received.append(signum)
        if len(received) == 1:
            stop_file.touch()
        elif process.poll() is None:
            os.kill(process.pid, signal.SIGINT if len(received) == 2 else signal.SIGKILL)

    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)} if in_main else {}
    try:
        yield received
    except BaseException:
        process.kill()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_file.unlink(missing_ok=True)


def stopped_line(received: list[int], last_step: int | None, steps: int | None, where: str | os.PathLike) -> str:
    """The one line that says where a run stopped on a signal."""
    name = signal.Signals(received[0]).name if received else "a signal"
    # verl reports step 0 for the validation before training
    done = "before its first step" if not last_step else f"after step {last_step}" + (f" of {steps}" if steps else "")
    return f"stopped by {name} {done}: every finished step is in {where}"


def run_trainer(
    command: list[str],
    log_file: str | os.PathLike,
    *,
    steps: int | None = None,
    rollout: str = "hf_generate",
    every: int = 1,
    out: TextIO = sys.stdout,
    stop_file: str | os.PathLike,
    **popen,
) -> tuple[int, str | None]:
    """Run a trainer whose stop file is ``stop_file`` (:func:`start_trainer`), follow it (:func:`follow`:
    a traceback once it was asked to stop only goes to the log) and pass on Ctrl-C and SIGTERM
    (:func:`forwarding_signals`). Returns (its exit status, :data:`verl_ext.stopping.INTERRUPTED` when
    it was asked to stop; the line that says where it stopped, else None)."""
    from verl_ext.stopping import INTERRUPTED

    process = start_trainer(command, **popen)
    with process, forwarding_signals(process, stop_file) as received:
        last_step = follow(process.stdout, log_file, steps, out=out, every=every, rollout=rollout, quiet=lambda: bool(received))
        process.wait()
    if not received:
        return process.returncode, None
    return INTERRUPTED, stopped_line(received, last_step, steps, Path(log_file).parent)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, command = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_file")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rollout", default="hf_generate", help="verl's name of the run's rollout (the progress names its server)")
    parser.add_argument("--lock", type=Path, default=None, metavar="DIR", help="hold DIR's lock; move an earlier run's metrics.jsonl and log to DIR/earlier/<UTC time>/ first")
    parser.add_argument("--label", default="progress", help="what the stop line starts with (default: progress)")
    parser.add_argument("--holder", default=None, help="the command named to a second one the lock refuses (default: the label)")
    args = parser.parse_args(own)
    if not command:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # copy to the end, when the trainer stopped, not before
        follow(sys.stdin, args.log_file, args.steps, rollout=args.rollout)
        return 0
    from verl_ext.apps.output_lock import keep_earlier_run, output_lock
    from verl_ext.cpu.overrides import METRICS_FILE
    from verl_ext.errors import UsageError
    from verl_ext.options import STOP_FILE

    directory = args.lock or Path(args.log_file).parent
    try:
        with output_lock(args.lock, args.holder or args.label) if args.lock else contextlib.nullcontext() as fd:
            if args.lock:  # an earlier run's log and metrics (verl's file logger appends): kept, moved aside
                log = Path(args.log_file).resolve()
                earlier = (METRICS_FILE, *([log.name] if log.parent == args.lock.resolve() else []))
                keep_earlier_run(args.lock, earlier, f"[{args.label}]")
            status, stopped = run_trainer(
                command, args.log_file, steps=args.steps, rollout=args.rollout, stop_file=directory / STOP_FILE,
                pass_fds=(fd,) if fd is not None else (),
            )  # fmt: skip
    except UsageError as error:
        print(f"[{args.label}] {error}", file=sys.stderr)
        return 2
    if stopped:
        print(f"[{args.label}] {stopped}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())

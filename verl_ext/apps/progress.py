"""Readable progress for a CPU run: keep verl's full output in a log, print one line per event.

verl prints every metric of a step on one very long line; on a terminal the phases of a run (Ray
start, workers, validation, steps) drown in it. ``recipes/cpu_demo.sh`` pipes the trainer through::

    python -m verl.trainer.main_ppo ... 2>&1 | python -m verl_ext.apps.progress LOG_FILE --steps N

which writes everything to LOG_FILE and prints: the startup phases, one line per training step with
its main metrics (verl-ext's ``ev_mc_last`` and ``top_token_share`` among them), validation scores,
and any traceback in full. From Python: :func:`follow`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import Iterable, TextIO

_STEP = re.compile(r"step:(\d+) - (.*)")
_METRIC = re.compile(r"([\w/@.\-]+):(?:np\.\w+\()?(-?[\d.]+(?:e-?\d+)?)")
_PHASES = {
    "Started a local Ray instance": "Ray started",
    "TaskRunner hostname": "task runner up (legacy RayPPOTrainer)",
    "TaskRunnerV1 pid": "task runner up (V1 PPOTrainer)",
    "LLMServerManager:": "HF-generate rollout server up",
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
    lines: Iterable[str], log_file: str | os.PathLike, steps: int | None = None, out: TextIO = sys.stdout, every: int = 1
):
    """Copy ``lines`` (a trainer's output) to ``log_file``; print the progress lines to ``out``:
    the step lines of every ``every``-th step, the first and last step and validation steps."""
    started, in_traceback, seen_phases = time.monotonic(), False, set()
    with open(log_file, "w") as log:
        for line in lines:
            log.write(line)
            log.flush()
            elapsed = f"{time.monotonic() - started:6.1f}s"
            if "Traceback (most recent call last)" in line:
                in_traceback = True
            if in_traceback:
                print(line, end="", file=out, flush=True)
                continue
            for marker, phase in _PHASES.items():
                if marker in line and phase not in seen_phases:
                    seen_phases.add(phase)
                    print(f"{elapsed}  {phase}", file=out, flush=True)
            match = _STEP.search(line)
            if match:
                step = int(match.group(1))
                metrics = {key: float(value) for key, value in _METRIC.findall(match.group(2))}
                shown = step % every == 0 or step in (1, steps) or any(k.startswith("val-core/") for k in metrics)
                summary = summarize_step(step, metrics, steps) if shown else None
                if summary:
                    print(f"{elapsed}  {summary}", file=out, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_file")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    follow(sys.stdin, args.log_file, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())

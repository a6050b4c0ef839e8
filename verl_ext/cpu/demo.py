"""``make demo`` (``verl-ext demo``): verl's real PPO trainer on CPU, traced, then inspected.

Runs ``python -m verl.trainer.main_ppo`` on Ray with verl-ext's CPU backend and config: a tiny
random llama learning "a+b=" prompts (built locally, nothing downloaded), ``algorithm.adv_estimator
=mc`` with the critic switched on by the plugin, KL in the reward, the per-token trace on. Then it
checks the trace against the definitions, prints one response's per-token table, the per-step
summary and the validation score before and after training, and draws the plots.

Exit code: the trainer's when it fails, else ``verl-ext check``'s (0 when every identity holds).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from verl_ext.errors import UsageError

def run_demo(args: argparse.Namespace) -> int:
    from verl_ext import cli

    started = time.monotonic()
    output = args.output_dir.resolve()
    trace_dir = output / "trace"
    try:
        output.mkdir(parents=True, exist_ok=True)
        (output / ".write-probe").touch()
        (output / ".write-probe").unlink()
    except OSError as error:
        raise UsageError(f"cannot write the demo's outputs to {args.output_dir}: {error.strerror or error}") from None

    _say(f"1/4 training: {args.steps} PPO steps of `{args.estimator}` on CPU with verl's real trainer (Ray)")
    status = _train(args, output, trace_dir)
    if status != 0:
        print(f"\n[demo] the trainer failed (exit {status}); its full output is in {output / 'train.log'}")
        return status

    _say("2/4 checking the trace against the definitions (docs/definitions.md §8)")
    checked = cli.main(["check", str(trace_dir), "--quiet"])
    last_step = _last_step(trace_dir)
    _say(f"3/4 one response of step {last_step}, token by token")
    cli.main(["show", str(trace_dir), "--step", str(last_step), "--sample", str(args.sample)])
    print()
    cli.main(["summary", str(trace_dir)])
    _print_validation(output)

    _say("4/4 plots")
    cli.main(["plot", str(trace_dir), "--out", str(output / "plots")])

    print(f"\n[demo] done in {time.monotonic() - started:.0f} s. Outputs in {output}:")
    print(f"  trace/          the per-token trace (verl-ext check|show|summary|plot {trace_dir})")
    print("  plots/          value, return and advantage curves, heatmap of one response")
    print("  train.log       verl's full output;  metrics.jsonl  verl's metrics, one line per step")
    return checked


def _train(args: argparse.Namespace, output: Path, trace_dir: Path) -> int:
    from verl_ext.cpu.assets import build_assets
    from verl_ext.cpu.overrides import METRICS_FILE, cpu_environment, cpu_overrides, merge_overrides
    from verl_ext.cpu.progress import follow

    overrides = merge_overrides(
        cpu_overrides(build_assets(), output, steps=args.steps, estimator=args.estimator, use_v1=args.v1),
        [
            "algorithm.use_kl_in_reward=True",
            "algorithm.kl_ctrl.kl_coef=0.01",
            f"trainer.test_freq={args.steps}",  # validation before training and after the last step
            f"verl_ext.trace.dir={trace_dir}",
        ],
        args.overrides,
    )
    configs = Path(__file__).resolve().parents[1] / "configs"
    command = [
        sys.executable, "-m", "verl.trainer.main_ppo",
        f"--config-path={configs}", "--config-name=verl_ext_trainer", *overrides,
    ]  # fmt: skip
    env = {**os.environ, **cpu_environment(output)}
    (output / METRICS_FILE).unlink(missing_ok=True)
    with subprocess.Popen(
        command, cwd=output, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as trainer:
        follow(trainer.stdout, output / "train.log", args.steps)
    return trainer.returncode


def _last_step(trace_dir: Path) -> int:
    from verl_ext.trace.reader import open_trace

    return open_trace(str(trace_dir)).steps[-1]


def _print_validation(output: Path) -> None:
    """Held-out accuracy and score before training (step 0) and after the last step (verl's metrics)."""
    from verl_ext.cpu.overrides import METRICS_FILE

    metrics = output / METRICS_FILE
    by_step: dict[int, dict[str, float]] = {}
    for line in (metrics.read_text().splitlines() if metrics.exists() else []):
        record = json.loads(line)
        for key, value in record["data"].items():
            if key.startswith("val-") and key.endswith(("/acc/mean@1", "/score/mean@1")):
                by_step.setdefault(record["step"], {})[key.split("/")[-2]] = value
    if len(by_step) >= 2:
        first, last = min(by_step), max(by_step)
        for name in sorted(by_step[first].keys() & by_step[last].keys()):
            print(f"held-out {name:5s}: {by_step[first][name]:.3f} before training, {by_step[last][name]:.3f} after step {last}")


def _say(message: str) -> None:
    print(f"\n[demo] {message}", flush=True)



"""``make demo`` (``verl-ext demo``): verl's real PPO trainer learns the CPU task, traced, then inspected.

1. The task and the warm start (:mod:`verl_ext.cpu.task`, :mod:`verl_ext.cpu.warm_start`): built
   once and cached, nothing downloaded.
2. Training: ``algorithm.adv_estimator=mc`` (the critic switched on by the plugin) with the recipe
   of :mod:`verl_ext.cpu.learning`, verl's ``RayPPOTrainer.fit()`` in a child process without Ray,
   the per-token trace on. verl validates on the held-out prompts before and after.
3. The trace checked against the definitions.
4. Where the credit lands, step by step (:mod:`verl_ext.cpu.credit`), and one response token by
   token with its verdict token's advantage.
5. Held-out accuracy before and after (verl's validation), and the plots.

Exit code: the trainer's when it fails, else ``verl-ext check``'s (0 when every identity holds).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run_demo(args: argparse.Namespace) -> int:
    from verl_ext import cli
    from verl_ext.trace.reader import open_trace

    started = time.monotonic()
    output = args.output_dir.resolve()
    trace_dir = output / "trace"

    _say("1/5 the task and the warm-started policy")
    _describe_task()

    _say(f"2/5 training: {args.steps} PPO steps of `{args.estimator}` with verl's real trainer (in process, CPU)")
    status = _train(args, output)
    if status != 0:
        print(f"\n[demo] the trainer failed (exit {status}); its full output is in {output / 'train.log'}")
        return status

    _say("3/5 checking the trace against the definitions (docs/definitions.md §8)")
    checked = cli.main(["check", str(trace_dir), "--quiet"])

    _say("4/5 where the credit lands: mean |advantage| at the verdict token against the rest")
    trace = open_trace(str(trace_dir))
    last_step = _print_credit(trace)
    sample = args.sample if args.sample is not None else _interesting_sample(trace, last_step)
    print()
    cli.main(["show", str(trace_dir), "--step", str(last_step), "--sample", str(sample)])
    _explain_verdict(trace, last_step, sample, args.estimator)
    _print_validation(output)

    _say("5/5 plots")
    cli.main(["plot", str(trace_dir), "--out", str(output / "plots"), "--sample", str(sample)])

    print(f"\n[demo] done in {time.monotonic() - started:.0f} s. Outputs in {output}:")
    print(f"  trace/          the per-token trace (verl-ext check|show|summary|plot|compare {trace_dir})")
    print("  plots/          value, return and advantage curves, heatmaps, the PPO picture")
    print("  train.log       verl's full output;  metrics.jsonl  verl's metrics, one line per step")
    return checked


def _describe_task() -> None:
    from verl_ext.cpu.assets import build_assets
    from verl_ext.cpu.task import Problem

    assets = build_assets()
    report = json.loads(assets.warm_start_report.read_text())
    right, wrong = Problem(2, 3, 5), Problem(2, 3, 6)
    print(f"  task: {right.question()} -> {right.answer()}    {wrong.question()} -> {wrong.answer()}")
    print("  reward on the last token: 1.0 fully right; else 0.2 for the right sum + 0.2 for the right verdict")
    greedy, sampled = report["held_out_greedy"], report["held_out_sampled"]
    print(
        f"  warm start ({report['settings']['steps']} supervised steps, verdict prior "
        f"{report['settings']['verdict_prior']}): held-out sum right {greedy['sum']:.2f} (greedy); "
        f"verdict right {sampled['verdict']:.2f} sampled, {greedy['verdict']:.2f} greedy"
    )


def _train(args: argparse.Namespace, output: Path) -> int:
    from verl_ext.cpu.progress import follow

    command = [
        sys.executable, "-m", "verl_ext.cpu.learning", str(output),
        "--estimator", args.estimator, "--seed", str(args.seed), "--steps", str(args.steps),
        "--test-freq", str(args.steps), "--trace", "--", *args.overrides,
    ]  # fmt: skip
    with subprocess.Popen(command, cwd=output, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as trainer:
        follow(trainer.stdout, output / "train.log", args.steps, every=10)
    return trainer.returncode


def _print_credit(trace) -> int:
    from verl_ext.cpu.credit import verdict_credit

    for step in trace.steps:
        print("  " + verdict_credit(trace, step).line())
    return trace.steps[-1]


def _interesting_sample(trace, step: int) -> int:
    """A response of ``step`` with the wrong verdict (its advantage shows the push back), else 0."""
    from verl_ext.cpu.credit import verdict_positions

    scores = trace.read_step(step, ["sample", "score"]).to_pandas().groupby("sample")["score"].sum()
    verdicts = verdict_positions(trace, step)
    wrong = [sample for sample, score in scores.items() if sample in verdicts and score < 1.0]
    return int(wrong[0]) if wrong else 0


def _explain_verdict(trace, step: int, sample: int, estimator: str) -> None:
    from verl_ext.cpu.credit import verdict_positions

    index = verdict_positions(trace, step).get(sample)
    if index is None:
        print("(this response has no verdict token)")
        return
    table = trace.read_step(step, ["sample", "token_index", "advantage", "value", "score"]).to_pandas()
    rows = table[table["sample"] == sample].set_index("token_index")
    score = rows["score"].sum()
    print(
        f"\nThe verdict is token {index}: advantage {rows.at[index, 'advantage']:+.3f} (whitened; value before it "
        f"{rows.at[index, 'value']:.3f}, score {score:.1f})."
        + (
            " mc gives every token return − value; the tokens before the verdict were near-certain, so the "
            "verdict's log-probability is what the update moves."
            if estimator == "mc"
            else ""
        )
    )


def _print_validation(output: Path) -> None:
    """Held-out accuracy before training (step 0) and after the last step (verl's validation metrics)."""
    from verl_ext.cpu.learning import read_metrics, validation_accuracy

    by_step = validation_accuracy(read_metrics(output))
    if len(by_step) >= 2:
        first, last = min(by_step), max(by_step)
        print(
            f"\nheld-out accuracy (verl's validation, 60 prompts x 8 samples at temperature 1): "
            f"{by_step[first]:.3f} before training, {by_step[last]:.3f} after step {last} "
            f"({100 * (by_step[last] - by_step[first]):+.1f} points)"
        )


def _say(message: str) -> None:
    print(f"\n[demo] {message}", flush=True)

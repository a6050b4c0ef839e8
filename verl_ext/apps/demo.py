"""``make demo`` (``verl-ext demo``): verl's real PPO trainer learns the CPU task, traced, then inspected.

1. The task, the warm start and the pretrained critic (:mod:`verl_ext.tasks.arith.task`,
   :mod:`verl_ext.tasks.arith.warm_start`, :mod:`verl_ext.tasks.arith.value_pretraining`): built once and cached,
   nothing downloaded.
2. Training: ``algorithm.adv_estimator=mc`` (the critic switched on by the plugin) with the recipe
   of :mod:`verl_ext.apps.learning`, verl's ``RayPPOTrainer.fit()`` in a child process without Ray (with
   ``--rollout vllm``: the responses from verl's own vLLM server, a Ray actor beside it),
   the per-token trace on. verl validates on the held-out prompts before and after.
3. The trace checked against the definitions.
4. Where the credit lands (:mod:`verl_ext.apps.credit`): every 10 steps the verdict token's share
   of Σ|A| and the critic's explained variance after the verdict; at the last step the share under
   mc, GAE(0.95) and td0 side by side, re-estimated from the recorded values; one response token
   by token, with its advantages under those estimators.
5. Held-out accuracy before and after (verl's validation), the plots, and the page that shows the
   run token by token in a browser (``verl-ext view``).

With ``--task tool`` (:mod:`verl_ext.tasks.tool`) the same five parts on the tool task: verl's own
tool agent loop, a calculator the policy may call, ``turn_gae`` (λ = 0 between turns) with the
task's pretrained critic by default; every 10 steps the share of responses that call the tool; at
the last step the share of Σ|A| on the call decision, on the verdict and on each turn under
turn_gae, mc, gae_ext and grpo (:func:`verl_ext.apps.credit.turn_advantages`), and one response
with a call turn by turn, then token by token, the tool's answer inline with mask 0.
``--turn-rewards`` adds the calculator's small reward for a well-formed call to the calling turn's
last token (``verl_ext.turn_rewards``; off by default).

Exit code: the trainer's when it fails, else ``verl-ext check``'s (0 when every identity holds).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

from verl_ext.apps.learning import RUN_OUTPUTS

#: What a demo writes in its output directory: an earlier demo's are moved to ``earlier/<UTC time>/``
#: before it starts (:func:`verl_ext.apps.output_lock.keep_earlier_run`), never deleted.
DEMO_OUTPUTS = (*RUN_OUTPUTS, "train.log", "plots", "view.html")


def check_demo(args: argparse.Namespace) -> None:
    """The demo's arguments and overrides checked before anything starts (no folder, no trainer): the
    config its trainer would compose, checked as the trainer's driver checks it
    (:func:`verl_ext.apps.learning.check_run`). UsageError, one line. Fills in ``steps`` and
    ``estimator`` when None (the task's, its record in :data:`verl_ext.tasks.TASKS`)."""
    from verl_ext.apps.learning import check_run
    from verl_ext.tasks import get_task

    task = get_task(args.task)
    if args.steps is None:
        args.steps = task.steps
    if args.estimator is None:
        args.estimator = task.estimator
    check_run(
        args.output_dir.resolve(), args.estimator, args.seed, args.steps, args.steps, True, _extra_overrides(args),
        task=args.task, precision=args.precision, rollout=args.rollout,
    )  # fmt: skip


def run_demo(args: argparse.Namespace) -> int:
    """The five parts (module docstring), holding the output directory's lock
    (:mod:`verl_ext.apps.output_lock`): a second demo into it is refused before it touches anything,
    and an earlier demo's outputs there are moved to ``earlier/<UTC time>/``. ``args``: the CLI's
    (``verl-ext demo --help``), checked by :func:`check_demo`."""
    from verl_ext.apps.output_lock import output_lock

    with output_lock(args.output_dir, "verl-ext demo") as lock:
        return _run_demo(args, lock)


def _extra_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides the demo adds to the learning recipe's: the turn rewards, then the user's (they win)."""
    return [*(["verl_ext.turn_rewards=true"] if args.turn_rewards else []), *args.overrides]


def _run_demo(args: argparse.Namespace, lock: int | None) -> int:
    from verl_ext.apps.output_lock import keep_earlier_run
    from verl_ext.check.run import check_trace
    from verl_ext.inspect.render import format_report
    from verl_ext.tasks import get_task
    from verl_ext.trace.reader import open_trace
    from verl_ext.view import write_page

    task = get_task(args.task)
    started = time.monotonic()
    output = args.output_dir.resolve()
    trace_dir = output / "trace"
    # an earlier demo's outputs are kept, moved aside (its trace would otherwise be merged into this one's)
    keep_earlier_run(output, DEMO_OUTPUTS, "[demo]")

    _say("1/5 the task, the warm-started policy" + (" and its pretrained critic" if task.pretrained_critic else ""))
    status, stopped = _train(args, output, before=task.describe, lock=lock)
    if stopped:
        print(f"\n[demo] {stopped}")
        return status
    if status != 0:
        print(f"\n[demo] the trainer failed (exit {status}); its full output is in {output / 'train.log'}")
        return status

    _say("3/5 checking the trace against the definitions (docs/definitions.md §8)")
    trace = open_trace(str(trace_dir))
    report = check_trace(trace)
    print(format_report(report), flush=True)

    _say("4/5 where the credit lands: the verdict token against the rest of the response")
    credits = _print_credit(trace, args.task)
    last_step = max(credits)
    verdicts = credits[last_step].verdicts
    if args.sample is not None:
        sample, why = args.sample, "the one --sample names"
    elif task.call_token is not None:
        sample, why = _sample_with_a_call(trace, last_step, verdicts)
    else:
        sample, why = _interesting_sample(trace, last_step, verdicts)
    print(f"  shown token by token below, in plots/ and first in view.html: sample {sample} of step {last_step}, {why}")
    if not credits[last_step].shares_by_estimator:
        print(f"\n  (no critic in this run: nothing to re-estimate {'turn_gae, mc and gae_ext' if task.call_token else 'mc, GAE and td0'} from)")
    elif task.call_token is not None:
        _print_turn_credit(trace, last_step, sample, args.task)
    else:
        _print_side_by_side(trace, credits, sample)
    print()
    _show(trace, last_step, sample)
    _explain_verdict(trace, last_step, sample, args.estimator, verdicts)
    _print_validation(output, args.task)

    _say("5/5 plots, and the run token by token in a browser")
    _plot(trace, output / "plots", sample)
    page = write_page(trace, output / "view.html", step=last_step, sample=sample)
    print(f"{page}  (open it in a browser; on a remote machine: scp it, or `verl-ext view {trace_dir}` behind `ssh -L`)")

    print(f"\n[demo] done in {time.monotonic() - started:.0f} s. Outputs in {output}:")
    print(f"  trace/          the per-token trace (verl-ext check|show|summary|plot|compare|view {trace_dir})")
    print("  view.html       every response token by token, coloured by advantage, value, ratio, …: one self-contained page")
    print("  plots/          value, return and advantage curves, heatmaps, the PPO picture")
    print("  train.log       verl's full output;  metrics.jsonl  verl's metrics, one line per step")
    return 0 if report.passed else 1


def _show(trace, step: int, sample: int) -> None:
    """What ``verl-ext show TRACE --step STEP --sample SAMPLE`` prints."""
    from verl_ext.inspect.render import render
    from verl_ext.steps.recorded import RecordedAlgorithm
    from verl_ext.inspect.table import decoder_for, sample_view

    decoder = decoder_for(trace)
    view = sample_view(trace, step, sample, decoder)
    if not decoder.available:
        print(f"note: {decoder.problem}; tokens are shown as ids", file=sys.stderr)
    print("\n".join(view.header(RecordedAlgorithm.from_record(trace.record))) + "\n")
    print(render(view.table, "text"), flush=True)


def _plot(trace, directory: Path, sample: int) -> None:
    """What ``verl-ext plot TRACE --out DIRECTORY --sample SAMPLE`` writes and prints; without
    matplotlib a note instead (the rest of the demo does not need it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        from verl_ext.inspect.plots import save_plots_with_notes
    except ImportError:
        print("note: the plots need matplotlib: pip install 'verl-ext[plot]'", file=sys.stderr)
        return
    paths, notes = save_plots_with_notes(trace, directory, None, sample)
    for message in notes:
        print(f"note: {message}", file=sys.stderr)
    print("\n".join(map(str, paths)), flush=True)


def _sample_with_a_call(trace, step: int, verdicts: dict[int, int]) -> tuple[int, str]:
    """(sample, why): the first response of ``step`` that called the tool (two assistant turns), has
    a verdict (``verdicts``: sample -> its token_index) and a score below 1; else the first that
    called with a score below 1; else the first that called; else 0."""
    prompts = trace.prompts(step).to_pandas().set_index("sample")
    scores = trace.read_step(step, ["sample", "score"]).to_pandas().groupby("sample")["score"].sum()
    called = [int(s) for s in scores.index if prompts.at[s, "assistant_turns"] == 2]
    wrong = [s for s in called if scores[s] < 1.0]
    judged = [s for s in wrong if s in verdicts]
    if judged:
        return judged[0], f"the first that called the tool, wrote a verdict and is not fully right (score {scores[judged[0]]:.1f})"
    if wrong:
        return wrong[0], f"the first that called the tool and is not fully right (score {scores[wrong[0]]:.1f})"
    if called:
        return called[0], "the first that called the tool (every call was right)"
    return 0, "the first response (none called the tool)"


def _train(args: argparse.Namespace, output: Path, before: Callable[[], None], lock: int | None) -> tuple[int, str | None]:
    """Start the trainer, run ``before`` (the task's description, which builds the assets), then
    follow the training; Ctrl-C or SIGTERM stop it between two steps (:func:`forwarding_signals`).
    Returns (its exit status, the line that says where it stopped, when it was asked to).

    The trainer spends its first seconds importing verl; on a first run that overlaps the asset
    build here, and its own ``build_assets()`` then waits for this one (the build holds a lock)."""
    from verl_ext.apps.progress import follow, forwarding_signals, start_trainer, stopped_line
    from verl_ext.cpu.overrides import user_modules_path
    from verl_ext.hf_rollout import ROLLOUT_NAME
    from verl_ext.options import STOP_FILE
    from verl_ext.stopping import INTERRUPTED

    command = [
        sys.executable, "-m", "verl_ext.apps.learning", str(output), "--task", args.task,
        "--estimator", args.estimator, "--seed", str(args.seed), "--steps", str(args.steps),
        "--test-freq", str(args.steps), "--trace", "--precision", args.precision, "--rollout", args.rollout, "--",
        *_extra_overrides(args),
    ]  # fmt: skip
    # the lock goes to the trainer; a module of VERL_USE_EXTERNAL_MODULES is found where the user started
    environment = {**os.environ, **user_modules_path()}
    trainer = start_trainer(command, cwd=output, env=environment, pass_fds=() if lock is None else (lock,))
    with trainer, forwarding_signals(trainer, output / STOP_FILE) as received:
        before()
        where = "in process" if args.rollout == ROLLOUT_NAME else "on a local Ray cluster, responses from verl's vLLM server"
        _say(f"2/5 training: {args.steps} PPO steps of `{args.estimator}` with verl's real trainer ({where}, CPU)")
        last = follow(trainer.stdout, output / "train.log", args.steps, every=10, rollout=args.rollout, quiet=lambda: bool(received))
        trainer.wait()
    if received:
        return INTERRUPTED, stopped_line(received, last, args.steps, output)
    return trainer.returncode, None


def _print_credit(trace, task: str, every: int = 10, late: int = 10) -> dict:
    """Every ``every``-th step (and the first and last): the verdict's share of the trained-on
    advantages and the critic's explained variance after the verdict. Returns step -> StepCredit
    of those steps and of the ``late`` last ones (with the side-by-side shares), each read once."""
    from verl_ext.apps.credit import side_by_side, step_credit

    steps, credits = trace.steps, {}
    for step in steps:
        shown = step % every == 0 or step in (steps[0], steps[-1])
        if shown or step in steps[-late:]:
            credits[step] = step_credit(trace, step, side_by_side() if step in steps[-late:] else (), task)
        if shown:
            print("  " + credits[step].line())
    return credits


def _print_side_by_side(trace, credits: dict, sample: int) -> None:
    """The verdict's share of Σ|raw A| under mc, GAE(0.95) and td0 on the last step and the late ones
    of ``credits`` (re-estimated from their recorded rewards and values), and ``sample`` of the last
    step token by token under each."""
    from verl_ext.apps.credit import SIDE_BY_SIDE_LAMBDA, side_by_side
    from verl_ext.inspect.comparison import compare
    from verl_ext.inspect.render import render

    labels = side_by_side()
    shares = {step: credit.shares_by_estimator for step, credit in credits.items() if credit.shares_by_estimator}
    late, step = sorted(shares), max(shares)
    lengths = trace.read_step(step, ["sample", "mask"]).to_pandas().groupby("sample")["mask"].sum()
    print(
        f"\n  the verdict token's share of Σ|raw advantage|, re-estimated from the recorded rewards and values "
        f"(one token's share is {1 / lengths.mean():.2f}):"
    )
    for label, by_step in ((f"step {step}", shares[step]), (f"mean of steps {late[0]}-{late[-1]}", None)):
        if by_step is None:
            by_step = {name: sum(shares[s][name] for s in late) / len(late) for name in labels}
        print(f"    {label:<22}" + "   ".join(f"{name} {share:.2f}" for name, share in by_step.items()))
    print("  mc gives every token G − V(s_t); td0 gives r_t + V(s_{t+1}) − V(s_t): with a critic that knows the")
    print("  outcome once the verdict is written, td0's credit sits on the verdict token itself.")
    table = compare(trace, step, sample, lambdas=(SIDE_BY_SIDE_LAMBDA,)).table
    columns = ["token_index", "token", "value", *labels]
    verdict = credits[step].verdicts.get(sample)
    where = f"its verdict is token {verdict}" if verdict is not None else "it has no verdict token"
    print(f"\n  sample {sample} of step {step} ({where}), raw advantages:\n")
    print(render(table.select(columns), "text", 3))


def _print_turn_credit(trace, step: int, sample: int, task: str) -> None:
    """On the tool task: the share of Σ|raw A| on the call decision, on the verdict and on each turn
    under turn_gae, mc, gae_ext and grpo on ``step`` (re-estimated from its recorded rewards and
    values; grpo from its scores and prompt groups), and ``sample`` turn by turn with each one's
    advantage at its call decision and its verdict."""
    from verl_ext.apps.credit import turn_advantages
    from verl_ext.inspect.table import decoder_for

    advantages = turn_advantages(trace, step, task)
    shares = advantages.shares()
    labels = list(shares)
    parts = list(next(iter(shares.values())))
    print(f"\n  the share of Σ|raw advantage| of step {step}, by estimator (re-estimated from the recorded rewards and values; grpo from the scores):")
    print("    " + " " * 14 + "".join(f"{part:>15}" for part in parts))
    for label in labels:
        print(f"    {label:<14}" + "".join(f"{shares[label][part]:>15.2f}" for part in parts))
    print("  turn_gae gives turn k's tokens Σ_j≥k (γλ)^(j−k)·δ_j with δ_j = r_j + V(next turn's start) − V(turn j's start); mc")
    print("  gives each token G − V(s_t); gae_ext GAE(λ=0.95) on every token; grpo one number per response, G against its group.")

    table = trace.read_step(step, ["sample", "token_index", "token_id", "mask", "turn"]).to_pandas()
    rows = table[table["sample"] == sample].sort_values("token_index")
    decoder = decoder_for(trace)
    mine = advantages.sample == sample
    at = {
        what: {label: raw[mine & flag] for label, raw in advantages.by_estimator.items()}
        for what, flag in (("call decision", advantages.decision), ("verdict", advantages.verdict))
    }
    decisions = (("call decision", 0), ("verdict", _verdict_index(advantages, sample)))
    print(f"\n  sample {sample} of step {step}, turn by turn, with the raw advantage at its decisions:")
    text = lambda piece: decoder.text(piece["token_id"].tolist()) if decoder.available else " ".join(map(str, piece["token_id"]))  # noqa: E731
    for turn, tokens in rows.groupby("turn", sort=True):
        written, hole = tokens[tokens["mask"]], tokens[~tokens["mask"]]  # a turn's hole follows its written tokens
        print(f"    turn {turn}  {text(written)}")
        written_at = set(written["token_index"])
        for what, index in decisions:
            if index is not None and index in written_at:
                values = "  ".join(f"{label} {at[what][label][0]:+.3f}" for label in labels)
                print(f"            {what} (token {index}): {values}")
        if len(hole):
            print(f"            ⟦{text(hole)}⟧  the tool's answer (mask 0, not trained)")


def _verdict_index(advantages, sample: int) -> int | None:
    flagged = advantages.token_index[(advantages.sample == sample) & advantages.verdict]
    return int(flagged[0]) if len(flagged) else None


def _interesting_sample(trace, step: int, verdicts: dict[int, int]) -> tuple[int, str]:
    """(sample, why): the response of ``step`` whose advantages show the update at work, by this rule:
    the first that is not fully right and whose verdict token (``verdicts``: sample -> its
    token_index) gets a negative advantage, the verdict the update pushes down; else the first not
    fully right with a verdict; else sample 0."""
    table = trace.read_step(step, ["sample", "token_index", "score", "advantage"]).to_pandas()
    scores = table.groupby("sample")["score"].sum()
    advantage = dict(zip(zip(table["sample"], table["token_index"]), table["advantage"]))
    wrong = [int(sample) for sample, score in scores.items() if sample in verdicts and score < 1.0]
    for sample in wrong:
        at_verdict = advantage.get((sample, verdicts[sample]))
        if at_verdict is not None and at_verdict < 0:
            return sample, (
                f"the first not fully right (score {scores[sample]:.1f}) whose verdict, token {verdicts[sample]}, "
                f"gets a negative advantage ({at_verdict:+.2f}): the update pushes that verdict down"
            )
    if wrong:
        return wrong[0], f"the first with a verdict that is not fully right (score {scores[wrong[0]]:.1f})"
    return 0, "the first response (every verdict was right)"


def _explain_verdict(trace, step: int, sample: int, estimator: str, verdicts: dict[int, int]) -> None:
    import pandas as pd

    index = verdicts.get(sample)
    if index is None:
        print("(this response has no verdict token)")
        return
    table = trace.read_step(step, ["sample", "token_index", "advantage", "value", "score"]).to_pandas()
    rows = table[table["sample"] == sample].set_index("token_index")
    score, value = rows["score"].sum(), rows.at[index, "value"]
    value = "" if pd.isna(value) else f"value before it {value:.3f}, "
    print(
        f"\nThe verdict is token {index}: advantage {rows.at[index, 'advantage']:+.3f} ({value}score {score:.1f})."
        + (
            " mc gives every token return − value; the tokens before the verdict were near-certain, so the "
            "verdict's log-probability is what the update moves."
            if estimator == "mc"
            else ""
        )
    )


def _print_validation(output: Path, task: str) -> None:
    """Held-out accuracy before training (step 0) and after the last step (verl's validation metrics)."""
    from verl_ext.apps.learning import read_metrics, validation_accuracy, validation_setting

    by_step = validation_accuracy(read_metrics(output))
    if len(by_step) >= 2:
        first, last = min(by_step), max(by_step)
        print(
            f"\nheld-out accuracy (verl's validation, {validation_setting(task)}): "
            f"{by_step[first]:.3f} before training, {by_step[last]:.3f} after step {last} "
            f"({100 * (by_step[last] - by_step[first]):+.1f} points)"
        )


def _say(message: str) -> None:
    print(f"\n[demo] {message}", flush=True)

"""Cut responses on a real run: ``algorithm.truncation`` = terminal, bootstrap and mask side by side
(docs/definitions.md#cut-responses-the-three-treatments-measured).

Three learning runs of the CPU task (:mod:`verl_ext.apps.learning`: verl's ``gae``, the pretrained
critic, one seed), one after the other, that differ only in the option. The responses are cut at
:data:`MAX_RESPONSE_LENGTH` tokens: a one-digit sum's answer ("等于7，是的！") is 7 tokens and its
EOS, a two-digit sum's is 8 and its EOS, so the two-digit answers lose their EOS and nothing else
(their text is complete: the reward scores it as any other) and the one-digit ones still end. Then
it prints, per option, what ``verl-ext summary`` says of the cut (means over steps), verl's held-out
accuracy before and after, the critic's explained variance, what the cut responses scored and the
critic's value after their last token, how often the policy came to be cut where the right answer
fits, what the critic said after the first step's cut responses, and ``verl-ext compare`` on the
bootstrap run's last step (the three treatments on one recorded step, shown on its first cut
response)::

    python -m verl_ext.apps.truncation_study OUTPUT_DIR [--steps 40] [--seed 0]

Each run is kept under ``OUTPUT_DIR/<option>/`` (trace, metrics.jsonl), its output in
``OUTPUT_DIR/<option>.out``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from verl_ext.truncation import TRUNCATION_MODES

ESTIMATOR = "gae"
MAX_RESPONSE_LENGTH = 8
STEPS = 40
#: The policy's late habits: means over the last this many steps.
LATE_STEPS = 10


@dataclass(frozen=True)
class OptionResult:
    """One run's figures; a mean over steps skips the steps where the figure is blank."""

    option: str
    truncated_share: float
    truncated_share_last: float  # at the last step: whether the policy came to be cut more or less often
    cut_where_it_fits: float  # over the last LATE_STEPS steps: cut although the right answer fits
    adv_truncated: float
    adv_rest: float
    accuracy_before: float
    accuracy_after: float
    explained_var: float  # verl's critic/vf_explained_var: against the returns the run trained on
    ev_mc: float  # against the Monte-Carlo return of the rewards: one yardstick for the three
    score_truncated: float  # mean score over every cut response of the run
    value_after_last: float | None  # mean V(s_L) over every cut response of the run (bootstrap only)
    seconds: float
    #: the first and the last step's cut responses: (scores, V(s_L)), bootstrap only
    first_step: tuple[np.ndarray, np.ndarray] | None = None
    last_step: tuple[np.ndarray, np.ndarray] | None = None


def train(run_dir: Path, option: str, steps: int, seed: int) -> float:
    """One learning run in its own process (verl's registries are process-global); its wall seconds."""
    command = [
        sys.executable, "-m", "verl_ext.apps.learning", str(run_dir), "--estimator", ESTIMATOR, "--seed", str(seed),
        "--steps", str(steps), "--test-freq", str(steps), "--trace", "--",
        f"data.max_response_length={MAX_RESPONSE_LENGTH}", f"algorithm.truncation={option}",
    ]  # fmt: skip
    print(f"[truncation] {' '.join(command[1:])}", flush=True)
    started = time.monotonic()
    with open(run_dir.parent / f"{option}.out", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.monotonic() - started


def read_result(run_dir: Path, option: str, seconds: float) -> OptionResult:
    from verl_ext.apps.learning import read_metrics, validation_accuracy
    from verl_ext.steps.cuts import StepCuts
    from verl_ext.steps.layout import StepData
    from verl_ext.inspect.summary import summarize
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(run_dir / "trace"))
    summary = summarize(trace).to_pydict()
    accuracy = validation_accuracy(read_metrics(run_dir))
    scores, values, steps_cut = [], [], []
    for step in trace.steps:
        data = StepData.read(trace, step, ["score"])
        cuts = StepCuts.read(trace, step, data.layout)
        per_sample = np.bincount(data.layout.valid_sample_index(), weights=data.columns["score"], minlength=data.layout.samples)
        scores += list(per_sample[cuts.cut])
        if cuts.bootstrap_value is not None:
            values += list(cuts.bootstrap_value[cuts.cut])
            steps_cut.append((per_sample[cuts.cut], cuts.bootstrap_value[cuts.cut]))
    return OptionResult(
        option=option,
        truncated_share=mean(summary["truncated_share"]),
        truncated_share_last=summary["truncated_share"][-1],
        cut_where_it_fits=mean([cut_where_the_answer_fits(trace, step) for step in trace.steps[-LATE_STEPS:]]),
        adv_truncated=mean(summary["adv_truncated"]),
        adv_rest=mean(summary["adv_rest"]),
        accuracy_before=accuracy[min(accuracy)],
        accuracy_after=accuracy[max(accuracy)],
        explained_var=mean(summary["explained_var"]),
        ev_mc=mean(summary["ev_mc"]),
        score_truncated=mean(scores),
        value_after_last=mean(values) if values else None,
        seconds=seconds,
        first_step=steps_cut[0] if steps_cut else None,
        last_step=steps_cut[-1] if steps_cut else None,
    )


def cut_where_the_answer_fits(trace, step: int) -> float:
    """The share of ``step``'s responses that were cut although their prompt's right answer and its EOS
    fit in :data:`MAX_RESPONSE_LENGTH` (a one-digit sum): the cut was the policy's doing, by a wrong
    two-digit sum or by not stopping after "！"."""
    import re

    from verl_ext.steps.cuts import StepCuts
    from verl_ext.steps.layout import StepData
    from verl_ext.tasks.arith.assets import build_tokenizer
    from verl_ext.tasks.arith.task import Problem

    tokenizer = build_tokenizer()
    prompts = trace.prompts(step)
    layout = StepData.read(trace, step, []).layout
    cuts = StepCuts.of(prompts, layout)
    fits = np.zeros(layout.samples, bool)
    for sample, ids in zip(prompts.column("sample").to_pylist(), prompts.column("prompt_token_ids").to_pylist()):
        a, b, c = map(int, re.search(r"请问(\d+)\+(\d+)=(\d+)？", tokenizer.decode(ids)).groups())
        fits[layout.index_of(np.array([sample]))[0]] = len(Problem(a, b, c).answer()) + 1 <= MAX_RESPONSE_LENGTH
    return float((cuts.cut & fits).mean())


def mean(values) -> float:
    """The mean of the values that are not None."""
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else float("nan")


def side_by_side(results: list[OptionResult], steps: int) -> str:
    """The results as one markdown table, one row per option."""
    lines = [
        "| `algorithm.truncation` | cut share (last step) | mean A, cut | mean A, rest "
        f"| held-out accuracy before → after {steps} steps | critic EV (verl's) | critic EV (vs G) | score of cut "
        f"| V(s_L) of cut | cut where the right answer fits, last {LATE_STEPS} steps | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        value = "—" if r.value_after_last is None else f"{r.value_after_last:.3f}"
        lines.append(
            f"| {r.option} | {r.truncated_share:.3f} ({r.truncated_share_last:.3f}) | {r.adv_truncated:+.3f} | {r.adv_rest:+.3f} "
            f"| {r.accuracy_before:.3f} → {r.accuracy_after:.3f} | {r.explained_var:.3f} | {r.ev_mc:.3f} "
            f"| {r.score_truncated:.3f} | {value} | {r.cut_where_it_fits:.3f} | {r.seconds:.0f} |"
        )
    return "\n".join(lines)


def cut_step_line(scores: np.ndarray, values: np.ndarray) -> str:
    """What the critic said after the cut responses of one step: their V(s_L) against the score each had
    already received on its last token (at the first step, before it trained on any bootstrapped return)."""
    by_score = ", ".join(
        f"score {score:g}: {np.mean(values[np.isclose(scores, score)]):.3f} ({np.isclose(scores, score).sum()})"
        for score in sorted(set(np.round(scores, 6)), reverse=True)
    )
    return (
        f"{len(scores)} cut responses, mean score {np.mean(scores):.3f}, mean V(s_L) {np.mean(values):.3f}, "
        f"correlation {np.corrcoef(scores, values)[0, 1]:.3f}; mean V(s_L) by score (responses): {by_score}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = args.output_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    seconds = {option: train(out / option, option, args.steps, args.seed) for option in TRUNCATION_MODES}
    results = [read_result(out / option, option, seconds[option]) for option in TRUNCATION_MODES]
    print(f"\n{ESTIMATOR}, seed {args.seed}, {args.steps} steps, data.max_response_length={MAX_RESPONSE_LENGTH}; "
          "means over steps unless said\n")  # fmt: skip
    print(side_by_side(results, args.steps), flush=True)
    for r in results:
        if r.first_step is not None:
            print(f"\n{r.option}, first step (the pretrained critic): {cut_step_line(*r.first_step)}", flush=True)
            print(f"{r.option}, last step ({args.steps} steps later): {cut_step_line(*r.last_step)}", flush=True)
    print(treatments_on_one_step(out / "bootstrap", args.steps), flush=True)
    return 0


def treatments_on_one_step(run_dir: Path, step: int) -> str:
    """``verl-ext compare``'s last two tables on ``step`` of the run: its cut responses under each
    treatment, and its first cut response token by token."""
    from verl_ext.inspect.comparison import compare
    from verl_ext.inspect.render import render
    from verl_ext.trace.reader import open_trace

    sample = first_cut(run_dir, step)
    comparison = compare(open_trace(str(run_dir / "trace")), step, sample)
    if comparison.treatments is None:
        return f"\nstep {step} of {run_dir} has no cut response"
    return "\n\n".join([
        f"\nverl-ext compare {run_dir / 'trace'} --step {step} --sample {sample}: the run's estimator under each "
        "truncation, over the step's valid tokens (adv: before whitening, 0 under mask):",
        render(comparison.treatments, "text", 4),
        f"sample {sample} (cut): advantages before whitening under each truncation",
        render(comparison.by_treatment, "text", 4),
    ])  # fmt: skip


def first_cut(run_dir: Path, step: int) -> int:
    """The first cut sample of ``step`` (0 when none is): compare then shows it under the three treatments."""
    from verl_ext.steps.cuts import StepCuts
    from verl_ext.steps.layout import StepData
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(run_dir / "trace"))
    layout = StepData.read(trace, step, []).layout
    cuts = StepCuts.read(trace, step, layout)
    return int(layout.sample_ids[np.flatnonzero(cuts.cut)[0]]) if cuts.cut is not None and cuts.cut.any() else 0


if __name__ == "__main__":
    sys.exit(main())

"""``verl-ext study``: every estimator, every seed, the same task, through verl's real trainer.

The task is the CPU task (``arith``) or, with ``--task tool``, the tool task
(:data:`verl_ext.tasks.TASKS`); either starts its critic from the task's pretrained one.

Each run is one ``python -m verl_ext.apps.learning`` process (verl's ``RayPPOTrainer.fit()`` in
process, the recipe and per-estimator options of :mod:`verl_ext.apps.learning`), traced without the
update tables. The critic starts from the pretrained one of the assets; with ``control``, every
estimator that uses a critic also runs with a fresh critic (the warm start with a new value head,
at the old recipe's lr 1e-3), the control. Finished runs are kept under
``DIR/runs/<estimator>[-fresh]-seed<k>/`` and reused when the study is run again with the same
settings, so an interrupted study loses at most the run in flight. Ctrl-C or SIGTERM stops the runs in
flight between two steps and starts no other (:mod:`verl_ext.stopping`); one line says how far it got.
The study holds its directory's lock (:mod:`verl_ext.apps.output_lock`), each run its own.

Outputs, rewritten after every run:

* ``DIR/results.csv``: one row per estimator, critic, seed and step: ``estimator, critic, seed,
  step, val_acc, score, critic_explained_var, ev_after_verdict, verdict_share`` and, on the tool
  task, ``call_start, calls_made, decision_share, share_turn1, ev_turn0, ev_after_hole`` (``critic``:
  ``pretrained``, ``fresh`` or ``none``; ``val_acc`` only at validation steps, step 0 being the
  validation before training; ``critic_explained_var`` (verl's) and ``ev_after_verdict`` (the
  critic against the Monte-Carlo return at the states after the verdict,
  :func:`verl_ext.apps.credit.step_credit`) empty without a critic; ``call_start``: the share of
  responses whose first token is the tool call, ``calls_made``: whose call the tool answered,
  ``decision_share``: the call decision's (first token's) share of Σ|A|, ``share_turn1``,
  ``ev_turn0`` and ``ev_after_hole``: the live metrics ``verl_ext/credit/share/turn1`` (the
  second turn's share of Σ|A|), ``verl_ext/critic/ev_mc/turn0`` and ``…/after_hole``,
  docs/live_metrics.md);
* ``DIR/learning_curves.png``: held-out accuracy and training score, the mean over seeds with a
  min–max band, per estimator;
* ``DIR/summary.md``: per estimator, the held-out accuracy before and after (mean ± std over seeds),
  the steps to reach the threshold, the critic's explained variance (verl's, and after the
  verdict) over the last 10 steps, the verdict token's share of Σ|A| (mean over steps), and the
  wall time per run; on the tool task also the calls at the last step, the shares of Σ|A| on the
  call decision and on the second turn and the critic's explained variance at turn 0 and after the
  hole, over the last 5 steps.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from verl_ext.apps.learning import (
    ESTIMATOR_OPTIONS,
    PROMPTS_PER_STEP,
    RUN_OUTPUTS,
    SAMPLES_PER_PROMPT,
    read_metrics,
    recipe,
    validation_accuracy,
    validation_setting,
)
from verl_ext.apps.output_lock import keep_earlier_run
from verl_ext.errors import UsageError
from verl_ext.options import import_external_modules
from verl_ext.tasks import DEFAULT_TASK, get_task

#: What a run of the study writes in its folder (``DIR/runs/<name>/``): an earlier attempt's are moved to
#: its ``earlier/<UTC time>/`` before the run trains again (:func:`verl_ext.apps.output_lock.keep_earlier_run`).
STUDY_RUN_OUTPUTS = (*RUN_OUTPUTS, "train.log", "run.json")
COLUMNS = ("estimator", "critic", "seed", "step", "val_acc", "score", "critic_explained_var", "ev_after_verdict", "verdict_share")
#: More columns on a task with a tool call (module docstring).
TOOL_COLUMNS = ("call_start", "calls_made", "decision_share", "share_turn1", "ev_turn0", "ev_after_hole")


@dataclass(frozen=True)
class StudySettings:
    steps: int
    test_freq: int
    threshold: float
    task: str = DEFAULT_TASK

    @property
    def columns(self) -> tuple[str, ...]:
        return COLUMNS + (TOOL_COLUMNS if get_task(self.task).call_token else ())


@dataclass(frozen=True)
class RunResult:
    estimator: str
    critic: str  # pretrained, fresh or none
    seed: int
    seconds: float
    rows: list[dict]  # one per step, COLUMNS
    failed: str | None = None
    reused: bool = False


def study_estimators(text: str | None = None) -> tuple[str, ...]:
    """The estimators to study: those named in ``text`` (``mc,td0,…``); by default the ones with a
    recipe of their own (:data:`~verl_ext.apps.learning.ESTIMATOR_OPTIONS`), then every other
    registered estimator that the default recipe can run.

    The default recipe, for an estimator without one of its own: no option set (its options at their
    defaults, γ = 1, λ = verl's 1.0), the same task, batches, seeds and steps, the pretrained critic
    when its registry entry needs a critic. A user's estimator is known once its module is imported:
    the study imports the modules of ``VERL_USE_EXTERNAL_MODULES``, as verl does in every run (which
    inherits the variable). UsageError for a name it cannot run.
    """
    from verl_ext import registry

    import_external_modules()
    if text is None:
        others = [e.name for e in registry.all_estimators() if e.name not in ESTIMATOR_OPTIONS and not _default_recipe_fails(e.name)]
        return (*ESTIMATOR_OPTIONS, *others)
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if registry.lookup(name) is None]
    if not names or unknown:
        raise UsageError(
            f"unknown estimator {', '.join(unknown) or repr(text)}: the study has a recipe for "
            f"{', '.join(ESTIMATOR_OPTIONS)} and runs any other registered estimator with the default recipe"
        )
    for name in names:
        problem = None if name in ESTIMATOR_OPTIONS else _default_recipe_fails(name)
        if problem:
            raise UsageError(
                f"estimator {name} cannot run with the default recipe ({problem}); "
                "give it a recipe in verl_ext.apps.learning.ESTIMATOR_OPTIONS"
            )
    return names


def _default_recipe_fails(name: str) -> str | None:
    """Why estimator ``name`` cannot run without options of its own (one it requires); None if it can."""
    from verl_ext import registry

    try:
        registry.get(name).settings({})
    except ValueError as exc:
        return str(exc)
    return None


def critics(estimator: str, control: bool) -> tuple[str, ...]:
    """The critics ``estimator`` runs with: none when its registry entry needs none, else the
    pretrained one (and, with ``control``, a fresh one)."""
    from verl_ext import registry

    if not registry.get(estimator).needs_critic:
        return ("none",)
    return ("pretrained", "fresh") if control else ("pretrained",)


def run_study(
    estimators: tuple[str, ...], seeds: int, settings: StudySettings, out: Path, jobs: int = 1, control: bool = False
) -> int:
    """Run the study (see the module docstring), ``jobs`` runs at a time; return 0, or 1 when a run failed.

    Each run trains on one thread (:mod:`verl_ext.apps.learning`): on a 2-core machine two jobs
    finish the study in little more than half the time of one.
    """
    from verl_ext.apps.output_lock import output_lock

    with output_lock(out, "verl-ext study"), _Stopping() as stopping:
        return _run_study(estimators, seeds, settings, out, jobs, control, stopping)


class _Stopping:
    """The study's stop: the first SIGINT or SIGTERM (in the main thread, while the study runs) asks
    every run in flight to stop between two steps (its stop file) and keeps new ones from starting;
    a second kills the runs."""

    def __init__(self):
        import threading

        self.signal: int | None = None
        self._lock = threading.Lock()
        self._running: dict[Path, subprocess.Popen] = {}

    def __enter__(self) -> "_Stopping":
        import signal
        import threading

        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        from verl_ext.options import STOP_FILE

        first = self.signal is None
        self.signal = self.signal or signum
        with self._lock:
            for run_dir, process in self._running.items():
                if first:
                    (run_dir / STOP_FILE).touch()
                elif process.poll() is None:
                    process.kill()

    def run(self, command: list[str], run_dir: Path, log) -> int | None:
        """``command`` in ``run_dir`` (a session of its own: the terminal's Ctrl-C reaches it only as the
        stop file); its exit status, or None when the study was stopped before it started."""
        from verl_ext.cpu.overrides import user_modules_path
        from verl_ext.options import STOP_FILE

        with self._lock:
            if self.signal is not None:
                return None
            (run_dir / STOP_FILE).unlink(missing_ok=True)
            env = {**os.environ, **user_modules_path()}
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=run_dir, env=env, start_new_session=True)
            self._running[run_dir] = process
        try:
            return process.wait()
        finally:
            with self._lock:
                self._running.pop(run_dir, None)
            (run_dir / STOP_FILE).unlink(missing_ok=True)


def _run_study(
    estimators: tuple[str, ...], seeds: int, settings: StudySettings, out: Path, jobs: int, control: bool, stopping: "_Stopping"
) -> int:
    runs = [(estimator, critic, seed) for estimator in estimators for critic in critics(estimator, control) for seed in range(seeds)]
    results: list[RunResult] = []
    started = time.monotonic()
    print(
        f"[study] {len(runs)} runs on the {settings.task} task ({', '.join(estimators)} x {seeds} seed(s){', with the fresh-critic control' if control else ''}), {settings.steps} steps each, "
        f"{jobs} at a time, into {out}",
        flush=True,
    )
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        pending = [pool.submit(_run_one, e, c, s, settings, out / "runs" / _run_name(e, c, s), stopping) for e, c, s in runs]
        for done, future in enumerate(as_completed(pending), start=1):
            result = future.result()
            if result is None:  # stopped before it started, or while it ran
                continue
            results.append(result)
            results.sort(key=lambda r: runs.index((r.estimator, r.critic, r.seed)))
            _write_outputs(results, settings, out)
            elapsed = time.monotonic() - started
            trained = [r.seconds for r in results if not r.reused]
            per_run = statistics.mean(trained) / jobs if trained else elapsed / done
            eta = per_run * (len(runs) - done)
            print(f"[study] {done}/{len(runs)} {_describe(result)}; elapsed {_clock(elapsed)}, ETA {_clock(eta)}", flush=True)
    if stopping.signal is not None:
        import signal

        print(
            f"[study] stopped by {signal.Signals(stopping.signal).name}: {len(results)} of {len(runs)} runs finished "
            f"(kept, and reused by the same study); {out / 'summary.md'} covers them",
            flush=True,
        )
        from verl_ext.stopping import INTERRUPTED

        return INTERRUPTED
    failed = [r for r in results if r.failed]
    print(f"[study] done in {_clock(time.monotonic() - started)}: {out / 'summary.md'}, results.csv, learning_curves.png", flush=True)
    if failed:
        print(f"[study] {len(failed)} run(s) failed; see their train.log under {out / 'runs'}", file=sys.stderr)
    return 1 if failed else 0


def _run_name(estimator: str, critic: str, seed: int) -> str:
    return f"{estimator}{'-fresh' if critic == 'fresh' else ''}-seed{seed}"


def _run_one(estimator: str, critic: str, seed: int, settings: StudySettings, run_dir: Path, stopping: _Stopping) -> RunResult | None:
    done_file = run_dir / "run.json"
    # what decides a run's outcome (the threshold only reads it)
    wanted = {
        "estimator": estimator, "critic": critic, "seed": seed, "steps": settings.steps, "test_freq": settings.test_freq,
        # the hash of what the warm start and the critic were built from
        "assets": get_task(settings.task).build_assets().root.name,
    }  # fmt: skip
    if settings.task != DEFAULT_TASK:  # a run of an earlier study (arith only) has no task key
        wanted["task"] = settings.task
    if done_file.exists():
        recorded = json.loads(done_file.read_text())
        if {key: recorded.get(key) for key in wanted} == wanted:
            return _read_run(estimator, critic, seed, recorded["seconds"], run_dir, settings.task, reused=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    # an earlier attempt (other settings, failed, stopped): kept under earlier/<time>/, not merged into this one
    keep_earlier_run(run_dir, STUDY_RUN_OUTPUTS, f"[study] {_run_name(estimator, critic, seed)}:")
    command = [
        sys.executable, "-m", "verl_ext.apps.learning", str(run_dir), "--task", settings.task, "--estimator", estimator, "--seed", str(seed),
        "--steps", str(settings.steps), "--test-freq", str(settings.test_freq), "--trace",
        *(["--fresh-critic"] if critic == "fresh" else []), "--", "verl_ext.trace.update=false",
    ]  # fmt: skip
    started = time.monotonic()
    with open(run_dir / "train.log", "w") as log:
        status = stopping.run(command, run_dir, log)
    seconds = time.monotonic() - started
    if status is None or stopping.signal is not None:
        return None  # a run stopped part of the way: not a result (run again, the study trains it again)
    if status != 0:
        return RunResult(estimator, critic, seed, seconds, [], failed=f"exit {status}")
    done_file.write_text(json.dumps({**wanted, "seconds": round(seconds, 1)}))
    return _read_run(estimator, critic, seed, seconds, run_dir, settings.task)


def _read_run(estimator: str, critic: str, seed: int, seconds: float, run_dir: Path, task: str, reused: bool = False) -> RunResult:
    from verl_ext.apps.credit import step_credit
    from verl_ext.step_metrics import EV_BUCKET, PREFIX, TURN_SHARE
    from verl_ext.trace.reader import open_trace

    trace = open_trace(str(run_dir / "trace"))
    credits = {step: step_credit(trace, step, (), task) for step in trace.steps}
    metrics = read_metrics(run_dir)
    accuracy = validation_accuracy(metrics)
    has_calls = get_task(task).call_token is not None
    rows = []
    for step, data in sorted(metrics.items()):
        credit = credits.get(step)
        row = {
            "estimator": estimator, "critic": critic, "seed": seed, "step": step, "val_acc": accuracy.get(step),
            "score": data.get("critic/score/mean"), "critic_explained_var": data.get("critic/vf_explained_var"),
            "ev_after_verdict": credit and credit.ev_after_verdict, "verdict_share": credit and credit.verdict_share,
        }  # fmt: skip
        if has_calls:
            row |= {
                "call_start": credit and credit.call_rate, "calls_made": credit and _calls_made(trace, step),
                "decision_share": credit and credit.decision_share,
                "share_turn1": data.get(PREFIX + TURN_SHARE.format(turn="turn1")),
                "ev_turn0": data.get(PREFIX + EV_BUCKET.format(bucket="turn0")),
                "ev_after_hole": data.get(PREFIX + EV_BUCKET.format(bucket="after_hole")),
            }  # fmt: skip
        rows.append(row)
    return RunResult(estimator, critic, seed, seconds, rows, reused=reused)


def _calls_made(trace, step: int) -> float:
    """The share of the step's responses whose call the tool answered (the agent loop's ``tool_calls``)."""
    calls = trace.prompts(step).column("tool_calls").to_numpy()
    return float((calls > 0).mean())


def _write_outputs(results: list[RunResult], settings: StudySettings, out: Path) -> None:
    with open(out / "results.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=settings.columns)
        writer.writeheader()
        for result in results:
            writer.writerows(result.rows)
    (out / "summary.md").write_text(summary_markdown(results, settings))
    try:
        learning_curves(results, settings.task).savefig(out / "learning_curves.png", dpi=120)
    except ImportError:
        pass  # matplotlib is optional ([plot]); the csv and the summary are written regardless


@dataclass(frozen=True)
class EstimatorSummary:
    estimator: str
    critic: str
    runs: int
    before: tuple[float, float]  # mean, std over seeds of the held-out accuracy at step 0
    after: tuple[float, float]  # ... at the last validated step
    steps_to_threshold: str
    explained_var: float | None  # mean over seeds of the last 10 steps' mean
    ev_after_verdict: float | None  # the same, after the verdict
    verdict_share: float | None
    seconds: float
    #: On the tool task (None elsewhere): at the last step, means over seeds; over the last 5 steps.
    call_start: float | None = None
    calls_made: float | None = None
    decision_share: float | None = None
    share_turn1: float | None = None
    ev_turn0: float | None = None
    ev_after_hole: float | None = None


def summarize(results: list[RunResult], settings: StudySettings) -> list[EstimatorSummary]:
    summaries = []
    for estimator, critic in dict.fromkeys((r.estimator, r.critic) for r in results):
        runs = [r for r in results if (r.estimator, r.critic) == (estimator, critic) and not r.failed]
        if not runs:
            continue
        validated = [[row for row in r.rows if row["val_acc"] is not None] for r in runs]
        before = [rows[0]["val_acc"] for rows in validated if rows]
        after = [rows[-1]["val_acc"] for rows in validated if rows]
        reached = [next((row["step"] for row in rows if row["val_acc"] >= settings.threshold), None) for rows in validated]
        hits = [step for step in reached if step is not None]
        steps_text = "not reached" if not hits else f"{statistics.mean(hits):.0f} ({len(hits)}/{len(runs)} seeds)"
        explained = [_mean([row["critic_explained_var"] for row in r.rows[-10:]]) for r in runs]
        after_verdict = [_mean([row["ev_after_verdict"] for row in r.rows[-10:]]) for r in runs]
        shares = [_mean([row["verdict_share"] for row in r.rows]) for r in runs]
        tool = {}
        if "call_start" in settings.columns:
            last = lambda column: _mean([r.rows[-1][column] for r in runs])  # noqa: E731
            late = lambda column: _mean([_mean([row[column] for row in r.rows[-5:]]) for r in runs])  # noqa: E731
            tool = {"call_start": last("call_start"), "calls_made": last("calls_made"), "decision_share": late("decision_share"),
                    "share_turn1": late("share_turn1"), "ev_turn0": late("ev_turn0"), "ev_after_hole": late("ev_after_hole")}  # fmt: skip
        summaries.append(EstimatorSummary(
            estimator, critic, len(runs), _mean_std(before), _mean_std(after), steps_text,
            _mean(explained), _mean(after_verdict), _mean(shares), statistics.mean(r.seconds for r in runs), **tool,
        ))  # fmt: skip
    return summaries


def summary_markdown(results: list[RunResult], settings: StudySettings) -> str:
    tool = "call_start" in settings.columns
    lines = [
        f"# Estimator study on the {settings.task} task",
        "",
        f"{settings.steps} PPO steps per run, {PROMPTS_PER_STEP} prompts × {SAMPLES_PER_PROMPT} responses per step; "
        f"held-out accuracy from verl's validation ({validation_setting(settings.task)}) "
        f"every {settings.test_freq} steps. Options: "
        + "; ".join(f"{name} {' '.join(_option(o) for o in recipe(name)) or '(none)'}" for name in _recipe_names(results))
        + ".",
        "",
        f"| estimator | critic | runs | held-out acc before | after | steps to ≥ {settings.threshold:g} | critic explained var (last 10 steps) | EV after the verdict (last 10 steps) | verdict share of Σ\\|A\\| | "
        + ("starts a call / calls made (last step) | Σ\\|A\\| share: call decision / turn 1 (last 5 steps) | critic EV at turn 0 / after the hole (last 5 steps) | " if tool else "")
        + "s per run |",
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if tool else "") + "---|",
    ]
    for s in summarize(results, settings):
        calls = (f"{_fmt(s.call_start)} / {_fmt(s.calls_made)} | {_fmt(s.decision_share)} / {_fmt(s.share_turn1)} | "
                 f"{_fmt(s.ev_turn0)} / {_fmt(s.ev_after_hole)} | ") if tool else ""  # fmt: skip
        lines.append(
            f"| {s.estimator} | {s.critic} | {s.runs} | {_pm(s.before)} | {_pm(s.after)} | {s.steps_to_threshold} | "
            f"{_fmt(s.explained_var)} | {_fmt(s.ev_after_verdict)} | {_fmt(s.verdict_share)} | {calls}{s.seconds:.0f} |"
        )
    failed = [f"{_run_name(r.estimator, r.critic, r.seed)} ({r.failed})" for r in results if r.failed]
    if failed:
        lines += ["", f"Failed runs: {', '.join(failed)}."]
    return "\n".join(lines) + "\n"


def _recipe_names(results: list[RunResult]) -> tuple[str, ...]:
    """The estimators whose options the summary lists: every one with a recipe, then the others studied."""
    return tuple(dict.fromkeys((*ESTIMATOR_OPTIONS, *(r.estimator for r in results))))


def learning_curves(results: list[RunResult], task: str = DEFAULT_TASK):
    """Held-out accuracy and training score per estimator: the mean over seeds and the min–max band."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    accuracy_axes, score_axes = fig.subplots(1, 2)
    for estimator, critic in dict.fromkeys((r.estimator, r.critic) for r in results):
        runs = [r for r in results if (r.estimator, r.critic) == (estimator, critic) and not r.failed]
        label = estimator + (" (fresh critic)" if critic == "fresh" else "")
        for axes, column in ((accuracy_axes, "val_acc"), (score_axes, "score")):
            curves = [{row["step"]: row[column] for row in r.rows if row[column] is not None} for r in runs]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not steps:
                continue
            values = np.array([[c[step] for step in steps] for c in curves])
            (line,) = axes.plot(steps, values.mean(axis=0), label=label, linestyle="--" if critic == "fresh" else "-", marker="o" if column == "val_acc" else None, markersize=3)
            axes.fill_between(steps, values.min(axis=0), values.max(axis=0), alpha=0.15, color=line.get_color())
    accuracy_axes.set(xlabel="step", ylabel="held-out accuracy (sampled)", title="verl's validation")
    score_axes.set(xlabel="step", ylabel="mean score of the step's responses", title="training")
    for axes in (accuracy_axes, score_axes):
        axes.grid(alpha=0.3)
        axes.legend(frameon=False, fontsize=8)
    fig.suptitle(f"Estimators on the {task} task: mean over seeds, min–max band")
    return fig


def _option(override: str) -> str:
    """``algorithm.lam_actor=0.95`` -> ``lam_actor=0.95``."""
    key, value = override.split("=", 1)
    return f"{key.split('.')[-1]}={value}"


def _describe(result: RunResult) -> str:
    name = _run_name(result.estimator, result.critic, result.seed)
    if result.failed:
        return f"{name}: FAILED ({result.failed}) after {result.seconds:.0f} s"
    validated = [row["val_acc"] for row in result.rows if row["val_acc"] is not None]
    change = f"held-out acc {validated[0]:.3f} -> {validated[-1]:.3f}" if validated else "no validation"
    return f"{name}: {change} in {result.seconds:.0f} s" + (" (reused)" if result.reused else "")


def _mean(values) -> float | None:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.mean(present) if present else None


def _mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def _pm(pair: tuple[float, float]) -> str:
    return f"{pair[0]:.3f} ± {pair[1]:.3f}"


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s"

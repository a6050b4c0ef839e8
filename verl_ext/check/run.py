"""``verl-ext check``: every identity of :data:`verl_ext.check.identities.IDENTITIES` on every traced
step, and the report as data (text: :func:`verl_ext.inspect.render.format_report`).

Recomputation runs the registered estimator itself in float64 on the trace's float32 inputs; the
trace is read one step at a time, so memory is bounded by one step. What each identity says and its
tolerance: :mod:`verl_ext.check.token_checks`, :mod:`verl_ext.check.update_checks`.

The verdict (:attr:`CheckReport.verdict`) is ``fail`` when an identity is violated, else
``incomplete`` when one that applies to the run could not be evaluated here (status ``unchecked``:
e.g. the run's estimator, whose module does not import in this process), else ``pass``. An identity
that does not apply (no critic, whitening off, ...) is ``skipped`` and leaves the verdict alone.

A step whose file does not read (cut short, moved, another write's) is not checked; the identity
``steps_on_disk`` fails it, naming the file, and every other step is checked. Whether the run
finished is the run record's (:class:`~verl_ext.steps.recorded.RecordedRun`): a run that did not
finish can pass, and its report says how far it got.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

import pyarrow as pa

from verl_ext.errors import StepFileError
from verl_ext.check import update_checks
from verl_ext.steps.cuts import StepCuts
from verl_ext.check.identities import IDENTITIES, RUN, TOKEN, UPDATE, Identity
from verl_ext.check.results import NOT_CHECKED, IdentityResult, StepResult, aggregate
from verl_ext.steps.layout import Progress, StepData, as_trace
from verl_ext.steps.recorded import RecordedAlgorithm, RecordedRun
from verl_ext.check.token_checks import QUANTITIES, RunScope, TokenStep
from verl_ext.trace.parallel import map_steps

__all__ = ["check_trace", "CheckReport"]


# --------------------------------------------------------------------------- the check


def check_trace(
    trace,
    steps: Iterable[int] | None = None,
    progress: Progress | None = None,
    *,
    jobs: int = 1,
    ray_address: str | None = None,
) -> CheckReport:
    """Check every identity on every traced step (or on ``steps``) of a trace (open, or its path); the
    steps in ``jobs`` processes or as Ray tasks (:func:`verl_ext.trace.parallel.map_steps`), with the
    same report as one by one."""
    trace = as_trace(trace)
    algorithm, checked, _ = _plan(trace)
    selected = tuple(trace.steps if steps is None else steps)
    per_step: list[StepResult] = []
    unreadable: dict[int, StepFileError] = {}
    tokens = 0
    names = {i.name for i in checked}
    for step, outcome in map_steps(trace, selected, check_step, jobs=jobs, ray_address=ray_address, progress=progress):
        if isinstance(outcome, StepFileError):  # the step is not checked; steps_on_disk fails it, the others go on
            unreadable[step] = outcome
            continue
        findings, step_tokens = outcome
        # a worker opens the trace later: of a run still writing, it may see update tables this listing lacks
        per_step.extend(StepResult(**vars(finding), identity=name, step=step) for name, finding in findings if name in names)
        tokens += step_tokens
    run = RunScope(trace, selected, everything=steps is None, unreadable=unreadable)
    for i in checked:
        if i.table == RUN:
            per_step.extend(StepResult(**vars(finding), identity=i.name, step=step) for step, finding in i.check(run))
    identities = tuple(
        aggregate(i.name, *i.describe(algorithm), [r for r in per_step if r.identity == i.name]) for i in checked
    )
    return CheckReport(str(trace.path), algorithm, selected, tokens, identities, tuple(per_step), RecordedRun.of(trace), tuple(sorted(unreadable)))


def _plan(trace) -> tuple[RecordedAlgorithm, list[Identity], bool]:
    """The run's estimator, the identities that apply to it, and whether the trace has update tables."""
    algorithm = RecordedAlgorithm.from_record(trace.record)
    with_updates = any(trace.update_steps.values())  # a trace without update tables has no §8.6 rows
    return algorithm, [i for i in IDENTITIES if (i.table != UPDATE or with_updates) and i.applies_to(algorithm)], with_updates


def check_step(trace, step: int) -> tuple[tuple[list, int], int]:
    """One step's findings, [(identity, finding)], and its valid tokens (twice: the value and the
    count :func:`~verl_ext.trace.parallel.map_steps` takes). StepFileError when a file of it does not read."""
    algorithm, checked, with_updates = _plan(trace)
    data = StepData.read(trace, step, QUANTITIES, rows_only=("turn", "role"))
    cuts = StepCuts.of(trace.prompts(step), data.layout)  # every file of the step must read
    contexts = {TOKEN: TokenStep(algorithm, trace.step_record(step), data, cuts)}
    if with_updates:
        contexts[UPDATE] = update_checks.UpdateStep(trace, step, data)
    findings = [(i.name, i.check(contexts[i.table])) for i in checked if i.table != RUN]
    return (findings, data.tokens), data.tokens


# --------------------------------------------------------------------------- the report


@dataclass(frozen=True)
class CheckReport:
    path: str
    algorithm: RecordedAlgorithm
    steps: tuple[int, ...]
    tokens: int
    identities: tuple[IdentityResult, ...]
    per_step: tuple[StepResult, ...]
    #: the run as a whole: whether it finished, its planned steps, its rollout engine (None: not read)
    run: RecordedRun | None = None
    #: the selected steps that were not checked because a file of theirs does not read
    unreadable: tuple[int, ...] = ()

    @property
    def verdict(self) -> str:
        """``fail`` when an identity is violated; else ``incomplete`` when one that applies to the run
        could not be evaluated here (:attr:`not_checked`); else ``pass``."""
        statuses = {result.status for result in self.identities}
        return "fail" if "fail" in statuses else "incomplete" if "unchecked" in statuses else "pass"

    @property
    def passed(self) -> bool:
        """Every identity that applies to the run was evaluated and holds."""
        return self.verdict == "pass"

    @property
    def not_checked(self) -> dict[str, tuple[str, ...]]:
        """Why identities that apply to the run were not evaluated here: reason -> those identities.
        E.g. the run's estimator, whose module does not import in this process."""
        reasons: dict[str, list[str]] = {}
        for result in self.per_step:
            if result.status == "unchecked":
                identities = reasons.setdefault(result.note.removeprefix(NOT_CHECKED), [])
                if result.identity not in identities:
                    identities.append(result.identity)
        return {reason: tuple(identities) for reason, identities in reasons.items()}

    def __getitem__(self, identity: str) -> IdentityResult:
        for result in self.identities:
            if result.identity == identity:
                return result
        raise KeyError(f"no identity {identity!r}; the report has {[r.identity for r in self.identities]}")

    def definition(self, identity: str) -> Identity:
        """The record of one of the report's identities (its section, what a violation counts)."""
        for record in IDENTITIES:
            if record.name == identity:
                return record
        raise KeyError(f"{identity!r} is not a check identity")

    def to_arrow(self) -> pa.Table:
        """One row per (identity, step): status, counts, max abs error, first violation."""
        rows = [
            {
                "identity": r.identity,
                "step": r.step,
                "status": r.status,
                "checked": r.checked,
                "violations": r.violations,
                "max_abs_error": r.max_abs_error,
                "first_sample": r.first.location.sample if r.first else None,
                "first_token_index": r.first.location.token_index if r.first else None,
                "first_violation": str(r.first) if r.first else None,
                "note": r.note,
            }
            for r in self.per_step
        ]
        return pa.Table.from_pylist(rows, schema=_PER_STEP_SCHEMA)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (per identity)."""
        return {
            "path": self.path,
            "estimator": self.algorithm.describe(),
            "steps": list(self.steps),
            "tokens": self.tokens,
            "unreadable_steps": list(self.unreadable),
            "run": None if self.run is None else {
                "finished": self.run.finished, "planned_steps": self.run.planned_steps,
                "last_step": self.run.last_step, "rollout": None if self.run.rollout is None else dict(self.run.rollout),
            },
            "verdict": self.verdict,
            "passed": self.passed,
            "not_checked": [{"reason": reason, "identities": list(names)} for reason, names in self.not_checked.items()],
            "identities": [
                {
                    **{k: v for k, v in dataclasses.asdict(r).items() if k != "first"},
                    "notes": list(r.notes),
                    "first_violation": None
                    if r.first is None
                    else {**dataclasses.asdict(r.first), "text": str(r.first)},
                }
                for r in self.identities
            ],
        }


_PER_STEP_SCHEMA = pa.schema(
    [
        ("identity", pa.string()),
        ("step", pa.int64()),
        ("status", pa.string()),
        ("checked", pa.int64()),
        ("violations", pa.int64()),
        ("max_abs_error", pa.float64()),
        ("first_sample", pa.int64()),
        ("first_token_index", pa.int64()),
        ("first_violation", pa.string()),
        ("note", pa.string()),
    ]
)

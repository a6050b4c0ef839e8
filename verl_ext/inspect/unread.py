"""The steps a scan of a trace could not read, and how the commands say so.

A step is *missing* when the run record lists it and its token file is not on disk (deleted, or a
copy of the trace that lost it), *unreadable* when its files are there but one of them does not read
(cut short, moved there from another step, a prompt table of another write: the reader's
:class:`~verl_ext.errors.StepFileError`). A command that walks the steps (``summary``, ``plot``,
``view``'s page) leaves such a step out, goes on with the others, and says which it left out and why,
one line each (:meth:`UnreadSteps.lines`); ``check`` fails them instead (identity ``steps_on_disk``,
docs/definitions.md §8, item 5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, TypeVar

from verl_ext.errors import StepFileError, TraceError
from verl_ext.trace.reader import listing

T = TypeVar("T")


@dataclass
class UnreadSteps:
    """The steps a scan left out: ``missing`` (the run record lists them, the disk lacks their token
    file) and ``unreadable`` (step -> the reader's one-line error, which names the file)."""

    missing: list[int] = field(default_factory=list)
    unreadable: dict[int, str] = field(default_factory=dict)

    @classmethod
    def of(cls, trace) -> "UnreadSteps":
        """The missing steps of ``trace``, none unreadable yet (a scan finds those)."""
        return cls(list(trace.missing_steps))

    def read(self, steps: Iterable[int], read: Callable[[int], T]) -> Iterator[tuple[int, T]]:
        """(step, ``read(step)``) for each of ``steps`` that reads; one whose file does not read is
        noted in :attr:`unreadable` and skipped."""
        for step in steps:
            try:
                value = read(step)
            except StepFileError as error:
                self.unreadable[step] = str(error)
                continue
            yield step, value

    def __bool__(self) -> bool:
        return bool(self.missing or self.unreadable)

    def lines(self) -> list[str]:
        """What was left out and why: one line for the missing steps, one per unreadable step."""
        lines = []
        if self.missing:
            steps = self.missing
            which = f"step {steps[0]} is" if len(steps) == 1 else f"steps {listing(steps)} are"
            lines.append(f"{which} listed in the run record but missing on disk: left out")
        lines += [f"step {step} is left out: {why}" for step, why in sorted(self.unreadable.items())]
        return lines


def readable(outcomes: Iterable[tuple[int, T]], unread: UnreadSteps | None) -> Iterator[tuple[int, T]]:
    """(step, value) of :func:`verl_ext.trace.parallel.map_steps`' outcomes whose step read; a step
    whose file did not is noted in ``unread`` and skipped (without ``unread``, its error is raised)."""
    for step, outcome in outcomes:
        if isinstance(outcome, StepFileError):
            if unread is None:
                raise outcome
            unread.unreadable[step] = str(outcome)
            continue
        yield step, outcome


def step_reads(trace, step: int) -> None:
    """Read what says whether a step is there at all, cheaply: its token file's footer and its prompt
    table (a file cut short loses its footer first). StepFileError when one does not read."""
    trace.step_record(step)
    trace.prompts(step)


def last_step_that_reads(trace, unread: UnreadSteps, read: Callable[[int], T] | None = None) -> tuple[int, T]:
    """(step, ``read(step)``) for the last step of ``trace`` where ``read`` (by default
    :func:`step_reads`) succeeds: what a command that shows one step looks at by default. Each later step
    whose files do not read is noted in ``unread``; a TraceError when no step reads."""
    if read is None:
        read = lambda step: step_reads(trace, step)  # noqa: E731
    for step in reversed(trace.steps):
        for _, value in unread.read([step], read):
            return step, value
    raise TraceError(f"{trace.path}: none of its {len(trace.steps)} steps reads (the last: {unread.unreadable[trace.steps[-1]]})")

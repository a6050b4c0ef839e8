"""Exceptions a user can act on; the CLI prints them as one line with exit code 2."""


class UsageError(Exception):
    """Bad input the user can fix (arguments, paths, configuration)."""


class TraceError(UsageError):
    """A trace that cannot be read: missing, not a trace, unknown schema version, corrupt file."""


class StepFileError(TraceError):
    """A file of one step that is missing or does not read (cut short, moved, another write's): the
    step cannot be read, the rest of the trace may be. ``step``: the step; ``file``: its path relative
    to the trace directory."""

    def __init__(self, message: str, step: int, file: str):
        super().__init__(message)
        self.step = step
        self.file = file

    def __reduce__(self):  # whole across processes (verl_ext.trace.parallel)
        return type(self), (str(self), self.step, self.file)


class ReplayError(ValueError):
    """One line for the user: ``verl-ext replay`` cannot be done as asked (its CLI says it, exit 2)."""


class WorkerLost(UsageError):
    """A worker process that ended before returning its step (killed: out of memory, by a signal)."""


def one_line(error: BaseException) -> str:
    """The first line of an exception's message (file errors can span many lines)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]

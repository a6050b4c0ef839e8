"""Exceptions a user can act on; the CLI prints them as one line with exit code 2."""


class UsageError(Exception):
    """Bad input the user can fix (arguments, paths, configuration)."""


class TraceError(UsageError):
    """A trace that cannot be read: missing, not a trace, unknown schema version, corrupt file."""


def one_line(error: BaseException) -> str:
    """The first line of an exception's message (file errors can span many lines)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]

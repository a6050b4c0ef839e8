"""The tool of the tool task: a plain function, registered with verl by :mod:`.tools`."""

from __future__ import annotations


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(int(a) + int(b))

"""The tool of the tool task: a plain function, registered with verl by :mod:`.tools`.

It also gives the call a small reward, as a user might for a well-formed call: both arguments are
integers in the call's JSON. verl keeps it in ``extra_fields["tool_rewards"]`` and leaves it out of
the token rewards; with ``verl_ext.turn_rewards=true`` it is added to the reward of the calling turn's
last token (docs/definitions.md §7). A malformed call earns nothing: verl answers an unknown name or
broken JSON itself with reward 0, and here arguments of another type get 0.
"""

from __future__ import annotations

#: The reward of a well-formed call (a tenth of a fully right answer's score).
TOOL_CALL_REWARD = 0.1


def add(a: int, b: int) -> tuple[str, float]:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    well_formed = all(type(x) is int for x in (a, b))
    return str(int(a) + int(b)), TOOL_CALL_REWARD if well_formed else 0.0

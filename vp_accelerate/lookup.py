"""Find a table entry by a name a person typed: any case, surrounding spaces ignored, a "did you mean".

The registries (`schedule/registry.py`, `modes.py`) each raise their own error type with their own wording;
this module is what they share. It imports nothing of the project.
"""

from __future__ import annotations

import difflib


def find(table: dict, name):
    """The entry of `table` called `name` (any case), or None."""
    if isinstance(name, str):
        return table.get(name.strip().lower())
    return None


def choices(table: dict, name) -> str:
    """ "choose one of a, b, c; did you mean 'b'?" for a `name` that is not in `table`."""
    hint = difflib.get_close_matches(str(name).lower(), list(table), n=1, cutoff=0.5)
    return f"choose one of {', '.join(table)}" + (f"; did you mean {hint[0]!r}?" if hint else "")


def lookup(table: dict, name, error: type[Exception], unknown: str):
    """The entry of `table` called `name` (any case); else `error` with "`unknown`; choose one of a, b, c; did you
    mean 'b'?" (each registry its own error type and the words that name what was looked up)."""
    entry = find(table, name)
    if entry is None:
        raise error(f"{unknown}; {choices(table, name)}")
    return entry

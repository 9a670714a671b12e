"""Every number a run wrote: for checks that a private count (rows of users) is written nowhere."""

from __future__ import annotations


def written_numbers(obj) -> list:
    """Every number in a JSON-like object except the ones under "config"."""
    if isinstance(obj, dict):
        return [x for k, v in obj.items() if k != "config" for x in written_numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in written_numbers(v)]
    return [obj] if isinstance(obj, int | float) and not isinstance(obj, bool) else []

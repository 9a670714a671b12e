"""The training recipe: every default of a run from what is public before it starts.

Why a module of its own: defaults tuned on one data set do not transfer, and defaults read
off the private data leak it. A recipe here is a pure function of public quantities only.
"""

from __future__ import annotations

DEFAULT_DELTA = 1e-5


def default_delta(n: int) -> float:
    """delta = min(1e-5, 1/n^1.1): below 1/n for every n, so "release one example" is not
    within the guarantee; the same rule for every task."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return min(DEFAULT_DELTA, float(n) ** -1.1)

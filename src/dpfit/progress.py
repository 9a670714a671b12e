"""Progress of long stretches outside the training loop (features, tokenisation, evaluation).

The library only reports ``(stage, done, total)`` to whoever listens; the CLI listens with a
progress bar. Listening is scoped with a context variable, so library callers that do not
ask see nothing, and no function signature (train's ``run`` replacements included) changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

Listener = Callable[[str, int, int], None]  # (stage, items done so far, items in all)

_listener: ContextVar[Listener | None] = ContextVar("dpfit_progress", default=None)


@contextlib.contextmanager
def listening(fn: Listener) -> Iterator[None]:
    """Send every report made inside the block to `fn`."""
    token = _listener.set(fn)
    try:
        yield
    finally:
        _listener.reset(token)


def report(stage: str, done: int, total: int) -> None:
    """`done` of `total` items of `stage` are finished (0 at the start, total at the end)."""
    fn = _listener.get()
    if fn is not None:
        fn(stage, done, total)

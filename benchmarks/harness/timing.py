"""Timing one call the same way in every micro-benchmark: repeats of a mean over several
calls, so one scheduler hiccup moves one repeat, not the figure."""

from __future__ import annotations

import statistics
import timeit
from collections.abc import Callable


def best_and_median_us(
    fn: Callable[[], object], number: int = 20, repeat: int = 15
) -> tuple[float, float]:
    """Best and median, in microseconds, of `repeat` means of `number` calls of `fn`."""
    runs = sorted(timeit.repeat(fn, number=number, repeat=repeat))
    return 1e6 * runs[0] / number, 1e6 * statistics.median(runs) / number


def best_ms(fn: Callable[[], object], number: int = 5, repeat: int = 7) -> float:
    """Best, in milliseconds, of `repeat` means of `number` calls of `fn`."""
    return 1000 * min(timeit.repeat(fn, number=number, repeat=repeat)) / number

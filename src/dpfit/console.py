"""What a person sees on the console: third-party chatter only when asked for (-v), and the
progress of each long phase, with how long it will take."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import TextIO


def quiet_hub_libraries() -> None:
    """Silence transformers' load reports and the hub's progress bars (shown again with -v)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import huggingface_hub.utils
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()


# -- progress of a phase -----------------------------------------------------------------------
# On a terminal a phase is a tqdm bar (with its ETA). Anywhere else (a log file, a pipe, CI) a
# bar's redraws are control codes and hundreds of lines, so a phase is a few plain lines: one
# per tenth of the work or per PLAIN_EVERY_S, whichever comes first. Timings go to the console
# only, never to a run's files (dpfit.reporting.PRIVATE_STEP_FIELDS says why).

ESTIMATE_AFTER = 3  # units done before a phase says how long it will take
ESTIMATE_AFTER_S = 10.0  # ... or this long after its first unit, if that comes first
PLAIN_EVERY_S = 30.0
PLAIN_EVERY_FRACTION = 0.1


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is an interactive terminal (where a redrawn bar belongs)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed file
        return False


def duration(seconds: float) -> str:
    """A human duration: '45 s', '9 min', '2 h 05 min'."""
    if seconds < 90:
        return f"{max(0, round(seconds))} s"
    minutes = round(seconds / 60)
    if minutes < 120:
        return f"{minutes} min"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def rate(seconds_per_unit: float, unit: str) -> str:
    """'12 s/step' for slow units, '3.4 step/s' for fast ones."""
    if seconds_per_unit >= 1:
        return f"{seconds_per_unit:.3g} s/{unit}"
    return f"{1 / max(seconds_per_unit, 1e-9):.3g} {unit}/s"


class PhaseProgress:
    """One phase's progress on `stream` (stderr): a bar on a terminal, plain lines elsewhere.

    ``estimate=True`` prints, once, how long the rest of the phase will take at the rate of
    its first units ("training: about 9 min left at 12 s/step"); the bar's ETA (or each plain
    line) keeps it up to date. The rate is measured from the first unit's end, so the first
    unit's one-off costs do not inflate it. ``delay``: say nothing for a phase that ends
    sooner.
    """

    def __init__(
        self,
        desc: str,
        total: int,
        unit: str,
        *,
        stream: TextIO | None = None,
        initial: int = 0,
        leave: bool = True,
        delay: float = 0.0,
        estimate: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.done = initial
        self.delay, self.estimate, self.clock = delay, estimate, clock
        self.postfix: dict[str, str] = {}
        self._start = clock()
        self._first: tuple[float, int] | None = None  # (time, units) at the first unit's end
        self._estimated = False
        self._printed_at: float | None = None  # plain lines: when the last one was printed
        self._printed_fraction = 0.0
        self._bar = None
        if is_terminal(self.stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total, initial=initial, desc=desc, unit=unit, file=self.stream,
                dynamic_ncols=True, leave=leave, delay=delay,
            )  # fmt: skip

    def seconds_per_unit(self) -> float | None:
        """The measured time per unit since the first unit ended, or None before two."""
        if self._first is None or self.done <= self._first[1]:
            return None
        t0, n0 = self._first
        return (self.clock() - t0) / (self.done - n0)

    def _left(self) -> str:
        per = self.seconds_per_unit()
        if per is None or self.total <= 0:
            return ""
        return f"about {duration(per * (self.total - self.done))} left at {rate(per, self.unit)}"

    def update_to(self, done: int, postfix: dict[str, str] | None = None) -> None:
        """`done` units of the phase are finished."""
        now = self.clock()
        if postfix is not None:
            self.postfix = postfix
        if self._first is None and done > self.done:
            self._first = (now, done)
        step = done - self.done
        self.done = done
        if self._bar is not None:
            self._bar.set_postfix(self.postfix, refresh=False)
            self._bar.update(step)
        self._maybe_estimate(now)
        if self._bar is None:
            self._maybe_plain_line(now)

    def _maybe_estimate(self, now: float) -> None:
        if not self.estimate or self._estimated or self._first is None:
            return
        measured = self.done - self._first[1]
        enough = measured >= ESTIMATE_AFTER - 1 or (
            measured >= 1 and now - self._first[0] >= ESTIMATE_AFTER_S
        )
        if enough and self.done < self.total:
            self._estimated = True
            self.write(f"{self.desc}: {self._left()} ({self.total - self.done} {self.unit}s to go)")

    def _maybe_plain_line(self, now: float) -> None:
        if now - self._start < self.delay or self.total <= 0:
            return
        fraction = self.done / self.total
        due = (
            self._printed_at is None
            or fraction >= self._printed_fraction + PLAIN_EVERY_FRACTION
            or now - self._printed_at >= PLAIN_EVERY_S
        )
        if due and self.done < self.total:
            self._printed_at, self._printed_fraction = now, fraction
            self._print(self._plain_line(now))

    def _plain_line(self, now: float) -> str:
        parts = [
            f"{self.desc}: {self.done}/{self.total} {self.unit}s ({100 * self.done / self.total:.0f}%)",
            f"{duration(now - self._start)} elapsed",
        ]
        left = self._left()
        if left:
            parts.append(left)
        parts += [f"{k}={v}" for k, v in self.postfix.items()]
        return ", ".join(parts)

    def _print(self, msg: str) -> None:
        print(msg, file=self.stream, flush=True)

    def write(self, msg: str) -> None:
        """A line of its own, above the bar (if any)."""
        if self._bar is not None:
            self._bar.write(msg, file=self.stream)
        else:
            self._print(msg)

    def close(self) -> None:
        """End the phase; plain output says it is done if it said anything before."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._printed_at is not None:
            took = duration(self.clock() - self._start)
            post = "".join(f", {k}={v}" for k, v in self.postfix.items())
            self._print(f"{self.desc}: {self.done}/{self.total} {self.unit}s in {took}{post}")
            self._printed_at = None

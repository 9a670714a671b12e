"""dpfit.console.PhaseProgress: how long a phase will take, a bar on a terminal and a few
plain lines anywhere else (a fake clock: no waiting)."""

import io
import re

from dpfit.console import PhaseProgress


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _steps(progress: PhaseProgress, clock: Clock, n: int, seconds: float) -> None:
    for i in range(1, n + 1):
        clock.t += seconds
        progress.update_to(i, {"eps": "0.1"})
    progress.close()


def test_the_time_left_is_said_after_the_first_steps_from_their_rate():
    out, clock = io.StringIO(), Clock()
    _steps(PhaseProgress("training", 50, "step", stream=out, estimate=True, clock=clock), clock,
           50, 12.0)  # fmt: skip
    lines = out.getvalue().splitlines()
    # slow steps: said once a measured interval (step 1 to 2) passes 10 s; 48 to go = 576 s
    assert "training: about 10 min left at 12 s/step (48 steps to go)" in lines
    assert sum("steps to go" in line for line in lines) == 1  # said once; lines keep it current


def test_fast_steps_are_timed_over_the_first_three():
    out, clock = io.StringIO(), Clock()
    _steps(PhaseProgress("training", 50, "step", stream=out, estimate=True, clock=clock), clock,
           50, 2.0)  # fmt: skip
    # step 1 to 3: 2 intervals of 2 s, 47 steps to go = 94 s
    assert "training: about 2 min left at 2 s/step (47 steps to go)" in out.getvalue()


def test_plain_lines_are_few_and_free_of_control_codes():
    out, clock = io.StringIO(), Clock()
    _steps(PhaseProgress("training", 1000, "step", stream=out, clock=clock), clock, 1000, 0.01)
    text = out.getvalue()
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) <= 11, lines  # one per tenth, and the end
    assert re.fullmatch(r"training: 1000/1000 steps in 10 s, eps=0\.1", lines[-1])
    assert "about" in lines[1] and "left at 100 step/s" in lines[1]


def test_slow_plain_phases_say_something_every_30_seconds():
    out, clock = io.StringIO(), Clock()
    _steps(PhaseProgress("clip vote", 1000, "client", stream=out, clock=clock), clock, 20, 10.0)
    assert len(out.getvalue().splitlines()) >= 200 / 30


def test_a_short_phase_with_a_delay_says_nothing():
    out, clock = io.StringIO(), Clock()
    _steps(PhaseProgress("tokenising", 10, "example", stream=out, delay=1.0, clock=clock), clock,
           10, 0.01)  # fmt: skip
    assert out.getvalue() == ""


def test_on_a_terminal_it_is_a_bar_and_the_estimate_a_line_above_it():
    out, clock = Terminal(), Clock()
    _steps(PhaseProgress("training", 50, "step", stream=out, estimate=True, clock=clock), clock,
           5, 2.0)  # fmt: skip
    text = out.getvalue()
    assert "\r" in text and "training: about 2 min left at 2 s/step (47 steps to go)" in text

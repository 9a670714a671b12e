"""The first-run benchmark: stage times read from the CLI's progress lines, and only a run on
an idle machine judges the 10 CPU-minute target."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def first_run():
    return load_benchmark("federated_first_run", "first_run_bench")


def test_stage_times_come_from_the_progress_lines(first_run):
    err = (
        "frozen features: 4864/8829 texts (55%), 2 min elapsed, about 2 min left\n"
        "frozen features: 8829/8829 texts in 6 min\n"
        "clip vote: 1000/1000 clients in 17 min\n"
        "clip vote: done\n"
    )
    assert first_run.stage_walls(err) == {"frozen features": 360.0, "clip vote": 1020.0}


def _row(cpu, load):
    return {
        "command": "dpfit federated", "cpu_seconds": cpu, "wall_seconds": 900.0,
        "load_avg_at_start": load, "load_avg_at_end": load, "stage_wall_seconds": {},
    }  # fmt: skip


@pytest.mark.parametrize(
    "cpu,load,verdict", [(500.0, 0.3, "met"), (700.0, 0.3, "NOT met"), (500.0, 5.0, "no")]
)
def test_only_an_idle_run_judges_the_target(first_run, cpu, load, verdict):
    assert first_run.report([_row(cpu, load)]).rstrip().endswith(f"| {verdict} |")

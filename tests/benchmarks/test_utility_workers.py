"""utility_workers: slices become utility.py arguments, and the workers' finished lines are
merged into one log (a line still being written is left for the next merge)."""

from __future__ import annotations

import argparse

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def workers():
    return load_benchmark("utility_workers")


def test_a_slice_names_tasks_rows_and_seeds(workers):
    args = workers.parse_slice("rotten-tomatoes,text-source:dp-8:0,2")
    assert args == [
        "--tasks",
        "rotten-tomatoes",
        "text-source",
        "--rows",
        "dp-8",
        "--seeds",
        "0",
        "2",
    ]
    for bad in ("rotten-tomatoes:dp-8", "a:b:c:d", "a::0", "a:b,:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            workers.parse_slice(bad)


def test_merge_keeps_finished_lines_only_and_replaces_the_merged_log(workers, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"key": 1}\n{"key": 2}\n')
    b.write_text('{"key": 3}\n{"key": 4, "half')  # the worker is still writing its last line
    into = tmp_path / "all.jsonl"
    into.write_text("stale\n")
    assert workers.merge([a, b, tmp_path / "missing.jsonl"], into) == 3
    assert into.read_text() == '{"key": 1}\n{"key": 2}\n{"key": 3}\n'


def test_the_workers_run_their_slices_into_one_log(workers, tmp_path):
    """Two real utility.py workers on the cheap rows (no model), merged at the end."""
    rc = workers.main(
        [
            "--out", str(tmp_path), "--tag", "t", "--deadline-s", "300",
            "--slice", "convention-party:majority:0,1", "--slice", "debate-role:majority:0",
        ]
    )  # fmt: skip
    import json

    assert rc == 0
    keys = {json.loads(x)["key"] for x in (tmp_path / "t_runs.jsonl").read_text().splitlines()}
    assert keys == {
        "convention-party|majority|0|trainall_testall",
        "convention-party|majority|1|trainall_testall",
        "debate-role|majority|0|trainall_testall",
    }

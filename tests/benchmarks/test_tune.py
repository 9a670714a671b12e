"""The `--tune` benchmark's pre-registered verdict, from synthetic pairs (no model trained)."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def tune():
    return load_benchmark("tune", "tune_bench")


def _rows(diffs: dict[str, list[float]]) -> list[dict]:
    rows = []
    for task, ds in diffs.items():
        for seed, d in enumerate(ds):
            rows.append({"task": task, "seed": seed, "arm": "untuned", "accuracy": 0.6})
            rows.append({"task": task, "seed": seed, "arm": "tune", "accuracy": 0.6 + d})
    return rows


def test_tuning_becomes_the_default_only_when_the_pooled_interval_is_above_zero(tune):
    text = tune.report(_rows({"a": [0.03, 0.04, 0.05], "b": [0.02, 0.03, 0.04]}))
    assert "it becomes the default" in text
    text = tune.report(_rows({"a": [0.03, 0.04, 0.05], "b": [-0.05, 0.03, 0.04]}))
    assert "stays off by default" in text


def test_a_task_below_three_seeds_is_left_out_of_the_verdict(tune):
    text = tune.report(_rows({"a": [-0.20, -0.30], "b": [0.03, 0.04, 0.05]}))
    assert "over 3 pairs" in text and "it becomes the default" in text
    assert "no verdict" in tune.report(_rows({"a": [0.1, 0.2]}))


def test_the_docs_block_is_the_committed_runs_rendered(tune):
    from harness.records import read_jsonl

    rows = read_jsonl(tune.LOG)
    text = tune.DOCS.read_text()
    begin, end = tune.MARKERS
    block = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert block == tune.docs_block(rows).strip()
    assert tune.REPORT.read_text() == tune.report(rows)
    assert "nothing yet" in tune.docs_block([])

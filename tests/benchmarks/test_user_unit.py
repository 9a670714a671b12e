"""benchmarks/user_unit.py: its docs block is rendered from the committed runs, not typed."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks")]

import user_unit  # noqa: E402
from harness.records import read_jsonl  # noqa: E402


def test_the_docs_block_is_the_committed_runs_rendered():
    rows = read_jsonl(user_unit.LOG)
    assert {(r["seed"], r["arm"]) for r in rows} >= {(0, "row"), (0, "user")}
    text = user_unit.DOCS.read_text()
    begin, end = user_unit.MARKERS
    block = text.split(begin, 1)[1].split(end, 1)[0].strip()
    assert block == user_unit.docs_block(rows).strip()
    assert user_unit.REPORT.read_text() == user_unit.report(rows)


def test_the_block_says_so_when_nothing_is_measured():
    assert "not measured yet" in user_unit.docs_block([])
    half = [{"seed": 0, "arm": "row", "accuracy": 0.7, "n": 10}]
    assert "not measured yet" in user_unit.docs_block(half)


def test_the_score_noise_is_the_library_s():
    from dpfit.run.tune import SCORE_NOISE

    assert user_unit.SCORE_NOISE == SCORE_NOISE

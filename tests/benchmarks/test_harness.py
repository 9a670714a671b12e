"""benchmarks/harness: the one copy of what the benchmark scripts share."""

from __future__ import annotations

import json
import math
import sys

import pytest
from benchmark_scripts import BENCHMARKS

if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

from harness import memory, records, render, stats, timing, workers  # noqa: E402


def test_jsonl_round_trip_skips_blank_lines_and_a_missing_log_is_empty(tmp_path):
    log = tmp_path / "sub" / "runs.jsonl"
    assert records.read_jsonl(log) == []
    records.append_jsonl(log, {"a": 1})
    records.append_jsonl(log, {"b": [2, 3]}, durable=True)
    log.write_text(log.read_text() + "\n  \n")
    assert records.read_jsonl(log) == [{"a": 1}, {"b": [2, 3]}]


def test_t_interval_is_the_closed_form_for_two_pairs():
    # df 1: the 97.5% quantile is tan(pi * 0.475); the interval is mean +- q * sd / sqrt(2)
    lo, hi = stats.t_interval([1.0, 3.0])
    half = math.tan(math.pi * 0.475) * math.sqrt(2) / math.sqrt(2)
    assert lo == pytest.approx(2.0 - half) and hi == pytest.approx(2.0 + half)
    assert stats.t_interval([1.0]) is None


def test_old_import_paths_give_the_same_objects():
    import doc_block
    import paired_t

    assert paired_t.t_interval is stats.t_interval
    assert doc_block.write_between_markers is render.write_between_markers


def test_block_between_markers_keeps_the_prose_and_refuses_a_page_without_them(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("intro\n<!-- b -->\nold\n<!-- e -->\noutro\n")
    render.write_between_markers(page, ("<!-- b -->", "<!-- e -->"), "new")
    assert page.read_text() == "intro\n<!-- b -->\nnew\n<!-- e -->\noutro\n"
    page.write_text("no markers")
    with pytest.raises(SystemExit, match="markers"):
        render.write_between_markers(page, ("<!-- b -->", "<!-- e -->"), "new")


def test_worker_result_is_its_last_line_and_a_failure_stops_with_its_stderr():
    code = "import json, sys; print('log line'); print(json.dumps({'x': 1}))"
    assert workers.run_json_worker([sys.executable, "-c", code], env={}) == {"x": 1}
    assert workers.last_json_line('noise\n{"y": 2}\n') == {"y": 2}
    fail = "import sys; sys.stderr.write('boom'); sys.exit(3)"
    with pytest.raises(SystemExit, match=r"worker failed \(w\):\nboom"):
        workers.run_json_worker([sys.executable, "-c", fail], env={}, label=" (w)")


def test_peak_rss_keeps_an_allocation_already_freed():
    resettable = memory.reset_peak_rss()
    base = memory.rss_now()
    block = bytearray(64 * 2**20)  # touched: resident
    for i in range(0, len(block), 4096):
        block[i] = 1
    assert memory.rss_now() - base >= 48 * 2**20
    del block  # a block this large is mapped on its own: freeing it returns it
    assert memory.peak_rss(resettable) - base >= 48 * 2**20


def test_timing_reports_best_not_above_median():
    best, median = timing.best_and_median_us(lambda: sum(range(100)), number=3, repeat=5)
    assert 0 < best <= median
    assert timing.best_ms(lambda: None, number=2, repeat=2) >= 0
    json.dumps([best, median])  # plain floats, as results record them

"""benchmarks/long_context_paired.py: both arms in one process, paired by round; the md is the
JSON's rendering."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import long_context_paired  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny run at two lengths (one process each, most of it importing torch): checked
    as it is, and merged into by the merge test."""
    out = tmp_path_factory.mktemp("paired") / "paired"
    argv = ["--model", "tiny", "--lengths", "8", "16", "--batches", "2", "--warmup", "1"]
    argv += ["--min-timed-s", "0"]
    assert long_context_paired.main([*argv, "--rounds", "3", "--out", str(out)]) == 0
    return out


def test_tiny_run_pairs_each_round(tiny):
    res = json.loads(tiny.with_suffix(".json").read_text())
    assert [(s["length"], s["batch"]) for s in res["settings"]] == [(8, 2), (16, 2)]
    for s in res["settings"]:
        for arm in long_context_paired.ARMS:
            assert len(s["cpu_s"][arm]) == 3 and all(c > 0 for c in s["cpu_s"][arm])
        want = [
            d / n for d, n in zip(s["cpu_s"]["dp-bitfit"], s["cpu_s"]["nonpriv-bias"], strict=True)
        ]
        assert s["ratios"] == want and s["ratio_min"] <= s["ratio_median"] <= s["ratio_max"]
    assert tiny.with_suffix(".md").read_text() == long_context_paired.render(res)


def test_committed_table_is_the_json_rendered():
    path = ROOT / "benchmarks" / "results" / "long_context_paired.json"
    res = json.loads(path.read_text())
    assert path.with_suffix(".md").read_text() == long_context_paired.render(res)


def test_merge_replaces_the_settings_measured_again(tiny, tmp_path):
    base = ["--model", "tiny", "--batches", "2", "--warmup", "0", "--rounds", "1"]
    base += ["--min-timed-s", "0"]
    second = tmp_path / "second"
    merge = ["--lengths", "16", "--out", str(second), "--merge", str(tiny.with_suffix(".json"))]
    assert long_context_paired.main([*base, *merge]) == 0
    res = json.loads(second.with_suffix(".json").read_text())
    assert [(s["length"], s["run"]) for s in res["settings"]] == [(8, 1), (16, 2)]
    assert len(res["runs"]) == 2
    md = second.with_suffix(".md").read_text()
    assert "- run 2: `" in md and md == long_context_paired.render(res)

"""benchmarks/long_context_paired.py: both arms in one process, paired by round; the md is the
JSON's rendering."""

from __future__ import annotations

import json
import os
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
            # user time and page faults per step, beside the thread's CPU time (which includes
            # them); getrusage splits time by sampled ticks, so a tiny step's user time may be 0
            assert len(s["user_s"][arm]) == len(s["minor_faults"][arm]) == 3
            pairs = zip(s["user_s"][arm], s["cpu_s"][arm], strict=True)
            assert all(0 <= u <= c + 1e-3 for u, c in pairs)
        want = [
            d / n for d, n in zip(s["cpu_s"]["dp-bitfit"], s["cpu_s"]["nonpriv-bias"], strict=True)
        ]
        assert s["ratios"] == want and s["ratio_min"] <= s["ratio_median"] <= s["ratio_max"]
        assert s["malloc"] == "default"
    assert tiny.with_suffix(".md").read_text() == long_context_paired.render(res)


def test_keep_runs_the_child_with_glibc_mmap_and_trim_off(monkeypatch):
    seen = {}

    def fake_run(cmd, env, **kw):
        seen.update(env)
        steps = {arm: [1.0] for arm in long_context_paired.ARMS}
        out = {"cpu_s": steps, "wall_s": steps, "user_s": steps}
        out["minor_faults"] = {arm: [0] for arm in long_context_paired.ARMS}
        return type("Done", (), {"stdout": json.dumps(out) + "\n"})()

    monkeypatch.setattr(long_context_paired.subprocess, "run", fake_run)
    s = long_context_paired.run_setting("tiny", 8, 1, 0, 1, 0.0, malloc="keep")
    assert seen["MALLOC_MMAP_MAX_"] == "0" and int(seen["MALLOC_TRIM_THRESHOLD_"]) >= 1 << 40
    assert s["malloc"] == "keep" and "| keep |" in long_context_paired.render(
        {"command": "c", "model": "tiny", "warmup": 0, "settings": [{**s, "run": 1}]}
    )
    seen.clear()
    long_context_paired.run_setting("tiny", 8, 1, 0, 1, 0.0)
    assert "MALLOC_MMAP_MAX_" not in seen or seen["MALLOC_MMAP_MAX_"] == os.environ.get(
        "MALLOC_MMAP_MAX_"
    )


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
    # another allocator is another row, not a replacement
    third = tmp_path / "third"
    merge = ["--lengths", "16", "--malloc", "keep", "--out", str(third)]
    merge += ["--merge", str(second.with_suffix(".json"))]
    assert long_context_paired.main([*base, *merge]) == 0
    rows = json.loads(third.with_suffix(".json").read_text())["settings"]
    assert [(s["length"], s.get("malloc"), s["run"]) for s in rows] == [
        (8, "default", 1), (16, "default", 2), (16, "keep", 3)
    ]  # fmt: skip
    assert len(res["runs"]) == 2
    md = second.with_suffix(".md").read_text()
    assert "- run 2: `" in md and md == long_context_paired.render(res)


def test_docs_page_is_the_rendering_of_the_committed_results():
    """docs/long_context.md is long_context.py's rendering of its committed JSON, with the
    allocator section and this benchmark's table (the time target) as committed."""
    import long_context

    res = json.loads((ROOT / "benchmarks" / "results" / "long_context.json").read_text())
    docs = long_context.render_docs(res, long_context.render(res), "long_context.png")
    assert (ROOT / "docs" / "long_context.md").read_text() == docs
    paired = (ROOT / "benchmarks" / "results" / "long_context_paired.md").read_text()
    assert paired.split("\n", 1)[1].strip() in docs

"""The round-time table in docs/federated.md is the script's rendering of the committed runs."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _benchmark():
    return load_benchmark("federated_round_time", "fed_round_time")


def test_docs_and_md_are_rendered_from_the_recorded_runs(tmp_path):
    bench = _benchmark()
    data = json.loads((RESULTS / "federated_round_time.json").read_text())
    text = bench.render(data)
    assert (RESULTS / "federated_round_time.md").read_text() == text
    docs = tmp_path / "federated.md"
    docs.write_text((ROOT / "docs" / "federated.md").read_text())
    bench.write_into_docs(text, docs)
    assert docs.read_text() == (ROOT / "docs" / "federated.md").read_text()
    rows = {(r["model"], r["local_mode"]) for r in data["rows"]}
    assert {("minilm", "bias"), ("smollm2", "lora")} <= rows

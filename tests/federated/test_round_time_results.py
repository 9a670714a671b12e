"""The round-time table in docs/federated.md is the script's rendering of the committed runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _benchmark():
    path = ROOT / "benchmarks" / "federated_round_time.py"
    spec = importlib.util.spec_from_file_location("fed_round_time", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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

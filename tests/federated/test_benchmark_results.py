"""The committed federated benchmark tables are the script's output for the committed runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _benchmark():
    spec = importlib.util.spec_from_file_location("fed_bench", ROOT / "benchmarks" / "federated.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_tables_are_rendered_from_committed_runs(tmp_path):
    bench = _benchmark()
    settings, rows, seconds = bench.load_recorded(RESULTS / "federated.json")
    bench.render(settings, rows, seconds, tmp_path)
    assert (tmp_path / "federated.md").read_text() == (RESULTS / "federated.md").read_text()
    assert (tmp_path / "federated.json").read_text() == (RESULTS / "federated.json").read_text()

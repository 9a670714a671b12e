"""The README timing benchmark times the command README shows, and its committed table is its
JSON's rendering."""

from __future__ import annotations

import json
from pathlib import Path

from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def test_reads_the_first_command_without_its_comment(tmp_path):
    bench = load_benchmark("readme_first_command")
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n```bash\nmake a && run b   # comment\nsecond line\n```\n")
    assert bench.readme_first_command(readme) == "make a && run b"


def test_the_real_readme_first_command_installs_then_trains():
    bench = load_benchmark("readme_first_command")
    command = bench.readme_first_command(ROOT / "README.md")
    assert command.startswith("bash scripts/setup.sh && ")
    assert "dpfit train" in command


def test_committed_table_is_the_json_rendered():
    bench = load_benchmark("readme_first_command")
    result = json.loads((RESULTS / "readme_first_command.json").read_text())
    assert (RESULTS / "readme_first_command.md").read_text() == bench.render(result)
    verdict = "met" if result["whole"]["wall_s"] <= 300 else "not met"
    assert f": {verdict} (" in bench.render(result)

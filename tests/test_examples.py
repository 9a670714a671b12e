"""Every script in examples/ runs end to end in its quick mode, as a user runs it (a
subprocess, offline), and prints an epsilon within its target and a score; README's examples
section states what the committed benchmark measured, not a figure typed by hand.

Quick modes train a few steps on tens of examples: the scores they print mean nothing, so
only their presence is checked. One torch thread per script, as in conftest: on a shared
2-core machine more threads only spin against each other.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
RESULT = re.compile(r"^epsilon (\S+) \(target (\S+),", re.M)
SCORE = re.compile(r"^(accuracy|perplexity) (\S+)", re.M)
README_TIME = ("<!-- readme_first_command:begin -->", "<!-- readme_first_command:end -->")

# script -> the optional packages it needs beyond the test environment's core
SCRIPTS = {
    "library_loop.py": ("transformers",),
    "trainer.py": ("transformers",),
    "causal_lm_jsonl.py": ("transformers", "gguf"),
    "federated_csv.py": ("transformers", "flwr"),
}


def run_example(script: str, *args: str, cwd: Path) -> str:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--quick", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def check_result(stdout: str) -> None:
    """An epsilon at or below its target, and a finite score."""
    found = RESULT.findall(stdout)
    assert len(found) == 1, stdout
    epsilon, target = (float(x) for x in found[0])
    assert 0 < epsilon <= target, stdout
    scores = SCORE.findall(stdout)
    assert len(scores) == 1 and math.isfinite(float(scores[0][1])), stdout


def test_every_example_is_run_here():
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(SCRIPTS)


@pytest.mark.slow
@pytest.mark.parametrize("script", ["library_loop.py", "causal_lm_jsonl.py", "federated_csv.py"])
def test_example_runs_and_reports_epsilon_and_score(script, tmp_path):
    for package in SCRIPTS[script]:
        pytest.importorskip(package)
    check_result(run_example(script, cwd=tmp_path))


@pytest.mark.slow
def test_trainer_example_stops_then_resumes_to_the_end(tmp_path):
    """The documented resume: a run stopped after step 2 (as a crash would stop it), then the
    same command with --resume, which finishes the run on the same ledger."""
    pytest.importorskip("transformers")
    out = str(tmp_path / "run")
    first = run_example("trainer.py", "--output-dir", out, "--stop-after-steps", "2", cwd=tmp_path)
    assert "stopped after step 2 of" in first and not RESULT.search(first)
    second = run_example("trainer.py", "--output-dir", out, "--resume", cwd=tmp_path)
    check_result(second)
    # the privacy record written with the model counts the steps of both invocations
    record = json.loads((tmp_path / "run" / "model" / "dpfit.json").read_text())
    assert record["steps"] > 2
    assert f"epsilon {record['epsilon']:.4f} (target" in second


def readme_time_block(result: dict) -> str:
    """README's sentence on what its first command costs, from the committed timing."""
    whole = result["whole"]
    return (
        f"Time: the first command at the top (install, then a default `dpfit train`) took "
        f"{whole['wall_s']} s of wall time ({whole['cpu_s']} CPU s) on {result['cpu_count']} "
        f"cores at commit `{result['commit']}` (`benchmarks/results/readme_first_command.md`)."
    )


def test_readme_states_the_committed_timing_of_its_first_command():
    result = json.loads((ROOT / "benchmarks/results/readme_first_command.json").read_text())
    text = (ROOT / "README.md").read_text()
    begin, end = README_TIME
    block = text[text.index(begin) + len(begin) : text.index(end)].strip()
    assert block == readme_time_block(result)


def test_readme_own_csv_command_uses_the_parser_defaults():
    from dpfit.cli import build_parser

    args = build_parser().parse_args(["train"])
    text = (ROOT / "README.md").read_text()
    line = f"--text-column {args.text_column} --label-column {args.label_column}"
    assert line in text

"""benchmarks/dropout.py: the utility criterion behind PRIVATE_DROPOUT, and the committed report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import dropout as bench  # noqa: E402

from dpfit.recipe import PRIVATE_DROPOUT  # noqa: E402


def _runs(values: dict[str, list[float]]) -> dict[str, dict[int, list[float]]]:
    return {t: {seed: [v] for seed, v in enumerate(vals)} for t, vals in values.items()}


ON = {
    "rotten-tomatoes": [78, 79, 77],
    "text-source": [75, 74, 76],
    "convention-party": [61, 60, 63],
}


def test_off_is_adopted_only_when_no_task_falls_below_and_the_mean_holds():
    same = bench.utility_verdict(_runs(ON), _runs(ON))
    assert same["verdict"] is True and abs(same["mean_diff"]) < 1e-12
    # one task's mean below its lowest dropout-on run fails, whatever the others gain
    low = {**ON, "convention-party": [59, 59.5, 59]}
    up = {**low, "rotten-tomatoes": [85, 85, 85]}
    assert bench.utility_verdict(_runs(up), _runs(ON))["verdict"] is False
    # every task inside its range but 0.6 points lower on average fails the mean test
    lower = {t: [v - 0.6 for v in vals] for t, vals in ON.items()}
    assert bench.utility_verdict(_runs(lower), _runs(ON))["verdict"] is False
    # fewer than 3 seeds on a task: no verdict
    short = {**ON, "text-source": [75, 74]}
    assert bench.utility_verdict(_runs(short), _runs(ON))["verdict"] is None


def test_runs_are_split_by_the_rate_they_ran_with(tmp_path):
    log = tmp_path / "runs.jsonl"
    rec = {"row": bench.ROW, "scale": bench.SCALE, "task": "text-source", "seed": 0}
    lines = [
        {**rec, "accuracy": 0.75},  # before the rule: no dropout field, the model's own
        {**rec, "accuracy": 0.76, "dropout": "model"},
        {**rec, "accuracy": 0.77, "dropout": 0.0},
        {**rec, "accuracy": 0.78, "dropout": 0.0, "error": "x"},
        {**rec, "accuracy": 0.79, "dropout": 0.0, "scale": "train1000_test500"},
    ]
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert bench._runs([log], False)["text-source"] == {0: [75.0, 76.0]}
    assert bench._runs([log], True)["text-source"] == {0: [77.0]}


def test_the_committed_report_is_the_rendering_of_the_committed_results_and_backs_the_rule():
    md = (bench.RESULTS / "dropout.md").read_text()
    assert md == bench.report()
    verdict = bench.utility_verdict(
        bench._runs([bench.OFF_LOG], True), bench._runs(bench.ON_LOGS, False)
    )
    # the recipe turns dropout off only with the check met
    assert verdict["verdict"] is (PRIVATE_DROPOUT == 0.0)

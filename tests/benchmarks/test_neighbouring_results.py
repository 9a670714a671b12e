"""The committed neighbouring benchmark (benchmarks/neighbouring.py): the figures quoted in
docs/threat-model.md are its output, and its epsilons are dp-accounting's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from accounting_oracle import ADD_REMOVE, REPLACE, direct_epsilon

ROOT = Path(__file__).resolve().parents[2]


def test_threat_model_quotes_the_committed_benchmark():
    """docs/threat-model.md's replace-one figures are benchmarks/results/neighbouring.json's,
    and those are dp-accounting's REPLACE_ONE epsilon for the noise the defaults calibrate."""
    rows = json.loads((ROOT / "benchmarks" / "results" / "neighbouring.json").read_text())
    doc = (ROOT / "docs" / "threat-model.md").read_text()
    for eps in (8.0, 1.0):
        (r,) = [
            r
            for r in rows
            if (r["target_epsilon"], r["accountant"], r["calibrated_to"])
            == (eps, "rdp", "add-remove")
        ]
        assert f"**{r['epsilon_replace_one']:.2f}**" in doc
        args = (r["noise_multiplier"], r["sample_rate"], r["steps"], r["delta"])
        assert r["epsilon_replace_one"] == pytest.approx(direct_epsilon(*args, REPLACE))
        assert r["epsilon_add_remove"] == pytest.approx(direct_epsilon(*args, ADD_REMOVE, "rdp"))
        assert r["epsilon_add_remove"] <= eps < r["epsilon_replace_one"]

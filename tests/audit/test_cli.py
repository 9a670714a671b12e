"""`dpfit audit` end to end on the synthetic model (the bundled-model run is in benchmarks/)."""

from __future__ import annotations

import json

from dpfit.cli import main


def test_audit_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "scores.png"
    rc = main(
        ["audit", "--model", "toy", "--epsilon", "4", "--canaries", "white-box",
         "--canaries-count", "300", "--insecure-seed", "0", "--json", "--plot", str(plot)]
    )  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    for key in (
        "epsilon_claimed",
        "epsilon_lower_bound",
        "confidence",
        "canaries",
        "guesses",
        "correct",
    ):
        assert key in out
    assert out["canaries"] == 300 and out["confidence"] == 0.95
    assert 0 <= out["epsilon_lower_bound"] < out["epsilon_claimed"] <= 4.0 + 1e-6
    assert out["correct"] <= out["guesses"] <= 300
    assert plot.stat().st_size > 1000


def test_audit_table_and_bad_input(capsys):
    assert main(["audit", "--model", "toy", "--canaries-count", "100", "--insecure-seed", "1"]) == 0
    text = capsys.readouterr().out
    assert "epsilon lower bound" in text and "consistent" in text and "certifiable" in text
    assert main(["audit", "--model", "toy", "--sample-rate", "1.5"]) == 2
    assert "sample-rate" in capsys.readouterr().err

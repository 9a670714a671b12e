"""`dpfit federated` through a tiny argparse: outputs, progress, engines (tiny sizes)."""

from __future__ import annotations

import argparse
import csv
import json

import pytest

from dpfit.federated.cli import add_arguments, run

TINY = [
    "--clients", "4", "--clients-per-round", "2", "--rounds", "2",
    "--examples-per-client", "8", "--eval-examples", "24", "--max-length", "24",
]  # fmt: skip


def _run(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(argv))


@pytest.mark.slow
def test_simulation_engine_writes_metrics_rounds_and_plots(tmp_path, capsys):
    out = tmp_path / "out"
    rc = _run([*TINY, "--method", "lac", "--epsilon", "8", "--output", str(out)])
    assert rc == 0
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("method", "epsilon", "delta", "accuracy", "rounds", "initial_clip", "final_clip"):
        assert key in metrics
    assert metrics["method"] == "lac" and metrics["rounds"] == 2
    assert 0 < metrics["epsilon"] <= 8.0 * (1 + 1e-6)
    assert metrics["final_clip"] <= metrics["initial_clip"]  # LAC never increases C
    rows = list(csv.DictReader(open(out / "rounds.csv")))
    assert [int(r["round"]) for r in rows] == [1, 2]
    for col in ("clip_norm", "val_loss", "accuracy", "epsilon", "noise_std"):
        assert col in rows[0]
    assert not any("client" in col for col in rows[0])  # exact counts are operator-only
    for png in ("clip.png", "accuracy.png", "epsilon.png"):
        assert (out / png).stat().st_size > 0
    assert "round   2/2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra",
    [
        ["--method", "clac", "--partition", "dirichlet", "--alpha", "0.5"],
        ["--method", "adaptive-quantile", "--partition", "movie", "--local-mode", "lora"],
    ],
)
def test_local_engine_methods_partitions_modes(extra, capsys):
    rc = _run([*TINY, "--engine", "local", "--json", *extra])
    assert rc == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["rounds"] == 2 and metrics["epsilon"] <= 8.0 * (1 + 1e-6)


def test_no_noise_reports_infinite_epsilon(capsys):
    rc = _run(
        [*TINY, "--engine", "local", "--json", "--method", "fixed", "--noise-multiplier", "0"]
    )
    assert rc == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["epsilon"] == "inf"


def test_impossible_budget_is_a_clear_error(capsys):
    rc = _run(
        [*TINY, "--engine", "local", "--method", "lac", "--epsilon", "0.1", "--vote-noise", "1"]
    )
    assert rc == 2
    assert "vote noise" in capsys.readouterr().err


def test_insecure_reproducible_noise_is_opt_in_and_recorded(capsys):
    base = [*TINY, "--engine", "local", "--json", "--method", "fixed", "--rounds", "1"]
    assert _run(base) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["insecure_seed"] is False
    assert _run([*base, "--insecure-reproducible-noise"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["insecure_seed"] is True
    assert "NOT private" in captured.err

"""The committed federated benchmark: tables rendered from its runs, epsilons that add up."""

from __future__ import annotations

from pathlib import Path

import dp_accounting as dpa
import pytest
from benchmark_scripts import load_benchmark
from dp_accounting import rdp

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
NAME = "federated_protocol"


def _benchmark():
    return load_benchmark("federated", "fed_bench")


@pytest.fixture(scope="module")
def recorded():
    return _benchmark().load_recorded(RESULTS / f"{NAME}.json")


@pytest.mark.parametrize("name", sorted(p.stem for p in RESULTS.glob(f"{NAME}*.json")))
def test_committed_tables_are_rendered_from_committed_runs(name, tmp_path):
    bench = _benchmark()
    settings, rows, seconds = bench.load_recorded(RESULTS / f"{name}.json")
    bench.render(settings, rows, seconds, tmp_path, name)
    for ext in ("md", "json"):
        assert (tmp_path / f"{name}.{ext}").read_text() == (RESULTS / f"{name}.{ext}").read_text()


def test_recorded_tuned_runs_spent_tuning_plus_training(recorded):
    """Each privately tuned run's epsilon is the selection (K ~ geometric candidate runs at
    the recorded candidate multiplier) composed with its own rounds, recomputed here with
    dp-accounting directly; it meets the target and exceeds what the selection alone spent."""
    settings, rows, _ = recorded
    tuned = [r for r in rows if r["protocol"] == "private tuning" and r["method"] == "fixed"]
    assert tuned, "the recorded run has no privately tuned fixed-clip rows"
    q = settings["clients_per_round"] / settings["clients"]
    for r in tuned[:2]:

        def run(z, rounds=r["rounds_run"]):
            return dpa.SelfComposedDpEvent(
                dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), rounds
            )

        acc = rdp.RdpAccountant()
        acc.compose(
            dpa.dp_event.RepeatAndSelectDpEvent(
                run(r["candidate_noise_multiplier"], settings["rounds"]),
                settings["tuning_mean_runs"],
                settings["tuning_shape"],
            )
        )
        acc.compose(run(r["noise_multiplier"]))
        direct = acc.get_epsilon(settings["delta"])
        assert r["epsilon"] == pytest.approx(direct, rel=1e-6)
        assert r["epsilon"] <= r["epsilon_target"] * (1 + 1e-3)
        assert r["tuning_epsilon"] == pytest.approx(
            settings["tuning_share"] * r["epsilon_target"], rel=1e-3
        )
        assert r["epsilon"] > r["tuning_epsilon"] + 0.5 * r["epsilon_target"]


@pytest.mark.parametrize("name", sorted(p.stem for p in RESULTS.glob("federated_central*.json")))
def test_committed_central_comparison_is_rendered_from_its_json(name):
    """FedAvg against central: the markdown is the rendering of the committed measurements."""
    import json

    module = load_benchmark("federated_central", "fed_central")
    data = json.loads((RESULTS / f"{name}.json").read_text())
    assert module.render(data) == (RESULTS / f"{name}.md").read_text()

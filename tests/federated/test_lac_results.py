"""The DP-LAC protocol's tables and docs section are the rendering of the recorded runs (the
full-scale protocol and the earlier reduced one); the paired intervals and the recorded
epsilons are recomputed independently (scipy's t quantile, dp-accounting directly)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from accounting_oracle import selected_then_trained_epsilon
from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def _benchmark():
    return load_benchmark("federated_lac")


def _runs():
    runs = []
    for name in _benchmark().RENDERED:
        path = RESULTS / f"{name}.jsonl"
        runs += [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return runs


def test_tables_and_docs_are_the_rendering_of_the_recorded_runs(tmp_path):
    bench = _benchmark()
    pilot, protocols = bench.render_all(RESULTS, bench.RENDERED)
    assert [name for name, _ in protocols] == list(bench.RENDERED)  # every JSONL is there
    for name, text in protocols:
        assert (RESULTS / f"{name}.md").read_text() == text
    assert (RESULTS / "federated_lac_pilot.md").read_text() == pilot
    docs = tmp_path / "federated.md"
    docs.write_text((ROOT / "docs" / "federated.md").read_text())
    bench.write_into_docs(bench.docs_section(pilot, protocols), docs)
    assert docs.read_text() == (ROOT / "docs" / "federated.md").read_text()


def test_only_the_protocol_scale_is_labelled_as_such():
    bench = _benchmark()
    full = {"clients": 1000, "clients_per_round": 100, "rounds_requested": 30}
    assert bench.scale_label(full) == "protocol scale"
    for key, small in (("clients", 500), ("clients_per_round", 50), ("rounds_requested", 10)):
        assert bench.scale_label({**full, key: small}) == "REDUCED scale"


def test_paired_interval_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    bench = _benchmark()
    diffs = [0.012, -0.004, 0.02]
    mean, lo, hi = bench.paired_interval(diffs)
    n = len(diffs)
    sd = (sum((d - mean) ** 2 for d in diffs) / (n - 1)) ** 0.5
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    assert (lo, hi) == pytest.approx((mean - half, mean + half), rel=1e-3)


def test_recorded_epsilons_recomputed_with_dp_accounting():
    """Rules with one Gaussian per round (fixed, automatic, lac: plus the vote once)."""
    import dp_accounting as dpa

    checked = 0
    for r in _runs():
        if r["method"] not in ("fixed", "automatic", "lac") or r["stopped"] or r.get("tuned"):
            continue
        q = r["clients_per_round"] / r["clients"]
        acc = dpa.rdp.RdpAccountant()
        if r["method"] == "lac":
            acc.compose(dpa.GaussianDpEvent(r["vote_noise_std"]))
        rounds = len(r["rounds"])
        acc.compose(
            dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(r["noise_multiplier"])), rounds
        )
        eps = acc.get_epsilon(1e-5)
        assert eps == pytest.approx(r["epsilon"], rel=1e-3)
        assert eps <= r["epsilon_target"] * (1 + 1e-3)
        checked += 1
    assert checked > 0


def test_recorded_tuned_epsilons_include_the_selection():
    """A tuned arm (automatic: one Gaussian per round; quantile: the update and the count's
    Gaussians, one combined multiplier): the selection over its candidates (RepeatAndSelect),
    then the final run, recomputed with dp-accounting."""
    tuned = [r for r in _runs() if r.get("tuned")]
    assert tuned  # the recorded protocol has tuned arms
    for r in tuned:
        assert r["epsilon"] <= r["epsilon_target"] * (1 + 1e-3)
        if r["method"] in ("automatic", "adaptive-quantile") and not r["stopped"]:
            sel = r["selection"]
            eps = selected_then_trained_epsilon(
                r["clients_per_round"] / r["clients"], r["rounds_requested"],
                r["candidate_noise_multiplier"], sel["mean_runs"], sel["shape"],
                r["noise_multiplier"], 1e-5,
            )  # fmt: skip
            assert eps == pytest.approx(r["epsilon"], rel=1e-3)


def _jsonl(name: str) -> list[dict]:
    return [json.loads(x) for x in (RESULTS / f"{name}.jsonl").read_text().splitlines() if x]


def test_vote_grid_variant_is_the_rendering_of_its_runs_paired_with_the_protocol():
    bench = _benchmark()
    grid, base = _jsonl(bench.GRID_NAME), _jsonl(bench.GRID_BASE)
    text = bench.render_grid(grid, base, bench.GRID_NAME, bench.GRID_BASE)
    assert (RESULTS / f"{bench.GRID_NAME}.md").read_text() == text
    assert all(r["method"] == "lac" and max(r["vote_factors"]) > 1 for r in grid)
    lac = {r["seed"]: r["test_accuracy"] for r in base if bench.arm(r) == "lac" and
           r["epsilon_target"] == 8.0}  # fmt: skip
    diffs = [r["test_accuracy"] - lac[r["seed"]] for r in grid if r["epsilon_target"] == 8.0]
    mean, lo, hi = bench.paired_interval(diffs)
    assert f"minus DP-LAC (paper's grid): {mean:+.4f} [{lo:+.4f}, {hi:+.4f}]" in text


def test_vote_grid_rendering_pairs_by_seed():
    bench = _benchmark()
    base = [r for r in _jsonl(bench.GRID_BASE) if r["epsilon_target"] == 8.0]
    fake = [
        {
            **r,
            "vote_factors": [0.5, 1.0, 2.0],
            "test_accuracy": r["test_accuracy"] + 0.01 * r["seed"],
        }
        for r in base
        if bench.arm(r) == "lac"
    ]
    text = bench.render_grid(fake, base, "x", bench.GRID_BASE)
    mean, lo, hi = bench.paired_interval([0.0, 0.01, 0.02])
    assert f"minus DP-LAC (paper's grid): {mean:+.4f} [{lo:+.4f}, {hi:+.4f}] (n=3)" in text
    assert "{0.5, 1, 2} x C_init" in text

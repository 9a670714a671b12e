"""The DP-LAC protocol's tables and its section of benchmarks/results/federated_history.md
(linked from docs/federated.md) are the rendering of the recorded runs (the
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
    page = RESULTS / "federated_history.md"  # docs/federated.md links it
    assert bench.DOCS == page
    docs = tmp_path / page.name
    docs.write_text(page.read_text())
    bench.write_into_docs(bench.docs_section(pilot, protocols), docs)
    assert docs.read_text() == page.read_text()
    assert "federated_history.md" in (ROOT / "docs" / "federated.md").read_text()


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


def test_measured_protocol_cpu_is_every_recorded_second():
    """The cost table's measured total is the recorded runs' CPU (candidate runs included)
    plus the cache fills, summed here straight from the JSONL files."""
    bench = _benchmark()
    name = "federated_lac_full"
    runs = _jsonl(name)
    setup = _jsonl(f"{name}_setup")
    cpu = sum(r["cpu_seconds"] + r.get("tuning_cpu_seconds", 0.0) for r in runs)
    fill = sum(s["cpu_seconds"] for s in setup)
    text = (RESULTS / f"{name}.md").read_text()
    assert f"| **{cpu / 3600:.2f}** |" in text
    assert f"= {(cpu + fill) / 3600:.2f} CPU-hours" in text
    parts = bench.cost_parts(runs)
    assert sum(p.measured for p in parts) == pytest.approx(cpu)
    assert sum(p.recorded for p in parts if "tuning candidate" in p.what) == sum(
        r.get("tuning_runs", 0) for r in runs
    )


def test_protocol_is_complete_only_with_every_cell():
    bench = _benchmark()
    row = {"seed": 0, "tuned": False}
    cells = [{**row, "method": bench.NON_PRIVATE, "epsilon_target": None}]
    for e in bench.PROTOCOL_EPS:
        for s in range(bench.PROTOCOL_SEEDS):
            cells += [{**row, "method": m, "epsilon_target": e, "seed": s} for m in bench.METHODS]
            cells += [
                {**row, "method": m, "epsilon_target": e, "seed": s, "tuned": True}
                for m in bench.TUNED
            ]
    assert bench.protocol_complete(cells)
    for i in range(len(cells)):
        assert not bench.protocol_complete(cells[:i] + cells[i + 1 :])


def test_c_star_is_the_best_recorded_fixed_clip_norm_paired_by_seed():
    """Synthetic rows: fixed C = 0.5 and C = 1 at two seeds; C* is the one with the higher
    test accuracy at each seed, and DP-LAC is paired with that run."""
    bench = _benchmark()

    def row(method, clip, seed, acc, **extra):
        return {"method": method, "epsilon_target": 2.0, "seed": seed, "initial_clip": clip,
                "test_accuracy": acc, **extra}  # fmt: skip

    runs = [
        row("lac", 1.0, 0, 0.70, c_star=1.0),
        row("lac", 1.0, 1, 0.60, c_star=0.5),
        row("fixed", 1.0, 0, 0.66),
        row("fixed", 0.5, 0, 0.68),
        row("fixed", 1.0, 1, 0.64),
        row("fixed", 0.5, 1, 0.55),
    ]
    text = "\n".join(bench.c_star_section(runs))
    assert "Fixed clip norms recorded: {0.5, 1}" in text
    assert "| 2 | 0 | 1 | 1 | 0.5 | 0.7000 | 0.6800 | +0.0200 |" in text
    assert "| 2 | 1 | 1 | 0.5 | 1 | 0.6000 | 0.6400 | -0.0400 |" in text
    assert "C_hist = C* in 1 of the 2 DP-LAC runs with a fixed run." in text
    mean, lo, hi = bench.paired_interval([0.02, -0.04])
    assert f"{mean:+.4f} [{lo:+.4f}, {hi:+.4f}] (n=2)" in text
    assert bench.c_star_section([r for r in runs if r["method"] == "lac"]) == []


def test_tuning_section_counts_candidates_at_the_majority_floor():
    """Synthetic tuned rows: a candidate within one validation example of the floor (or
    below it) learned nothing; 'the pick is arbitrary' only when every candidate did."""
    bench = _benchmark()
    floor = {"validation": {"majority_accuracy": 0.6717}}

    def tuned(eps, scores):
        return {"method": "automatic", "tuned": True, "epsilon_target": eps, "seed": 0,
                "val_examples": 600, "hyperparameters": {"initial_clip": 1.0},
                "candidate_scores": [{"hyperparameters": {"initial_clip": 1.0},
                                      "val_accuracy": s} for s in scores],
                "tuning_runs": len(scores), "tuning_cpu_seconds": 1.0, "tuning_seconds": 1.0,
                "candidate_noise_multiplier": 1.0, "noise_multiplier": 1.0,
                "epsilon": eps}  # fmt: skip

    runs = [tuned(2.0, [403 / 600, 0.3]), tuned(8.0, [403 / 600, 0.675, 0.7])]
    text = "\n".join(bench.tuning_section(runs, floor))
    assert "eps 2: 2 of 2 candidate runs score at or below" in text
    assert "eps 2: 2 of 2" in text and "(every one: the pick is arbitrary)" in text
    assert "eps 8: 1 of 3 candidate runs" in text
    assert text.count("the pick is arbitrary") == 1


def test_c_star_reads_the_fixed_clip_sweep_paired_by_seed_and_setting():
    """Synthetic rows: the protocol's fixed C = 1 and a sweep at C = 0.25 and 0.5 (one sweep
    row in another setting, which must not be paired); C* is taken over all paired norms."""
    bench = _benchmark()

    def row(method, clip, seed, acc, lr=0.5, **extra):
        return {"method": method, "epsilon_target": 8.0, "seed": seed, "initial_clip": clip,
                "test_accuracy": acc, "rounds_requested": 30, "clients": 1000,
                "clients_per_round": 100.0, "local_optimizer": "sgd", "lr": lr, **extra}  # fmt: skip

    runs = [
        row("lac", 1.0, 0, 0.70, c_star=1.0, vote_factors=[0.25, 0.5, 1.0]),
        row("lac", 1.0, 1, 0.60, c_star=1.0, vote_factors=[0.25, 0.5, 1.0]),
        row("fixed", 1.0, 0, 0.66),
        row("fixed", 1.0, 1, 0.64),
    ]
    sweep = [
        row("fixed", 0.25, 0, 0.69),
        row("fixed", 0.5, 0, 0.68),
        row("fixed", 0.25, 1, 0.50),
        row("fixed", 0.5, 1, 0.62),
        row("fixed", 0.5, 1, 0.99, lr=0.1),  # another setting: not paired
    ]
    text = "\n".join(bench.c_star_section(runs, sweep))
    assert "Fixed clip norms recorded: {0.25, 0.5, 1}" in text
    assert "eps 8: 0.25 (seeds 0 1), 0.5 (seeds 0 1), 1 (seeds 0 1)" in text
    assert "At eps 8 the measured norms cover the vote's candidates" in text
    assert "--methods fixed --fixed-clip 0.25 0.5 --epsilons 8 --seeds 0 1" in text
    assert "(seed mean): C = 0.25: 0.5950, C = 0.5: 0.6500, C = 1: 0.6500" in text
    assert "| 8 | 0 | 1 | 1 | 0.25 | 0.7000 | 0.6900 | +0.0100 |" in text
    assert "| 8 | 1 | 1 | 1 | 1 | 0.6000 | 0.6400 | -0.0400 |" in text
    assert "C_hist = C* in 1 of the 2 DP-LAC runs with a fixed run." in text
    mean, lo, hi = bench.paired_interval([0.70 - 0.69, 0.60 - 0.64])
    assert f"{mean:+.4f} [{lo:+.4f}, {hi:+.4f}] (n=2)" in text
    # without the sweep, C* is C = 1 at both seeds and the text says no sweep was recorded
    alone = "\n".join(bench.c_star_section(runs))
    assert "no sweep of the fixed rule over them was recorded" in alone
    assert "| 8 | 0 | 1 | 1 | 1 | 0.7000 | 0.6600 | +0.0400 |" in alone


def test_sweep_is_rendered_into_the_protocol_it_pairs_with():
    bench = _benchmark()
    path = RESULTS / f"{bench.SWEEP_NAME}.jsonl"
    if not path.exists():
        pytest.fail(f"{path.name} is not recorded")
    sweep = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    base = (RESULTS / f"{bench.SWEEP_BASE}.md").read_text()
    assert sweep and all(r["method"] == "fixed" and r["initial_clip"] != 1.0 for r in sweep)
    norms = " ".join(f"{c:g}" for c in sorted({r["initial_clip"] for r in sweep}))
    assert f"--fixed-clip {norms}" in base


def test_recorded_no_vote_runs_spend_their_whole_target_on_the_rounds():
    """DP-LAC without the vote: the recorded epsilon is dp-accounting's for the rounds alone
    (no vote in the ledger), and it is the target (the vote's share went to the rounds)."""
    from accounting_oracle import ADD_REMOVE, direct_epsilon

    bench = _benchmark()
    path = RESULTS / f"{bench.NOVOTE_NAME}.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    assert rows and all(r["method"] == bench.NOVOTE for r in rows)
    for r in rows:
        q = r["clients_per_round"] / r["clients"]
        rounds = len(r["rounds"])
        want = direct_epsilon(r["noise_multiplier"], q, rounds, 1e-5, ADD_REMOVE, kind="rdp")
        assert r["epsilon"] == pytest.approx(want, rel=1e-3)
        assert r["epsilon"] == pytest.approx(r["epsilon_target"], rel=2e-3)
        assert r["vote_counts"] == []

"""The DP-LAC benchmark's shortcuts change no result: a vote read back from the memo gives
the run a fresh vote gives (also at another seed, whose vote query is the same), and a
privately tuned arm spends its whole target, selection included (recomputed with
dp-accounting)."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np
import pytest
from accounting_oracle import selected_then_trained_epsilon
from benchmark_scripts import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
TIMINGS = ("seconds", "cpu_seconds", "vote_time_s")


def _benchmark():
    return load_benchmark("federated_lac")


# Training rows kept: the IID partition places each row by its own keyed hash, so client
# sizes vary (binomially); 40 rows left a client of 20 empty, 100 give each at least 2.
TRAIN_ROWS = 100


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """20 clients, 5 a round, 2 rounds; the training split cut to TRAIN_ROWS examples (no
    client empty: asserted), validation and test to 40 each, for the whole module."""
    import dpfit.federated.app as app
    import dpfit.federated.bundled as bundled
    from dpfit.federated.examples import client_examples

    bench = _benchmark()
    splits = bundled.splits

    def cut(seed: int):
        return tuple(s[:n] for s, n in zip(splits(seed), (TRAIN_ROWS, 40, 40), strict=True))

    args = argparse.Namespace(
        clients=20, clients_per_round=5.0, rounds=2, max_length=32, val_examples=0,
        local_optimizer="sgd", lr=0.5, cache_file=None, vote_memo=None,
    )  # fmt: skip
    mp = pytest.MonkeyPatch()
    mp.setattr(bundled, "splits", cut)  # what the clients' examples are read from
    mp.setattr(app, "splits", cut)  # the name the benchmark reads validation and test by
    bundled.partitions.cache_clear()  # partitions of the full split must not be reused
    try:
        task, engine, val, test, _ = bench.setup(args)
        sizes = [len(client_examples(task, p)) for p in range(task.num_clients)]
        assert min(sizes) >= 1, f"a client holds no example: {sizes}"
        yield bench, args, task, engine, val, test, tmp_path_factory.mktemp("memo")
    finally:
        mp.undo()
        bundled.partitions.cache_clear()


def _strip(row: dict) -> dict:
    out = {k: v for k, v in row.items() if k not in TIMINGS}
    out["rounds"] = [{k: v for k, v in r.items() if k not in TIMINGS} for r in row["rounds"]]
    return out


def test_vote_memo_gives_the_same_run_at_another_seed(small):
    bench, args, task, engine, val, test, memo = small
    engine.memo = None
    fresh = bench.one_run("lac", 8.0, 1, args, task, engine, val, test)
    engine.memo = memo
    engine.memo_hits = 0
    bench.one_run("lac", 8.0, 0, args, task, engine, val, test)  # computes and keeps it
    assert engine.memo_hits == 0 and len(list(memo.glob("vote_*.npy"))) == 1
    reused = bench.one_run("lac", 8.0, 1, args, task, engine, val, test)
    assert engine.memo_hits == 1
    assert _strip(reused) == _strip(fresh)  # exactly: accuracy, C_t, losses, votes


def test_vote_memo_keys_apart_what_changes_the_query(small):
    bench, args, task, engine, val, test, memo = small
    engine.memo = memo
    before = engine.memo_hits
    bench.one_run("lac", 2.0, 0, args, task, engine, val, test)  # another vote multiplier
    assert engine.memo_hits == before
    assert len(list(memo.glob("vote_*.npy"))) == 2


def test_tuned_arm_spends_its_target_with_the_selection(small):
    bench, args, task, engine, val, test, _ = small
    row = bench.tuned_run("automatic", 8.0, 0, args, task, engine, val, test)
    grid = bench._grids()["automatic"]
    assert row["tuned"] and row["tuning_runs"] == len(row["candidate_scores"]) >= 1
    assert all(c["hyperparameters"] in grid for c in row["candidate_scores"])
    best = max(row["candidate_scores"], key=lambda c: c["val_accuracy"])
    assert row["hyperparameters"] == best["hyperparameters"]  # the best score is released
    assert row["initial_clip"] == best["hyperparameters"]["initial_clip"]
    assert recomputed_epsilon(row) == pytest.approx(row["epsilon"], rel=1e-3)
    assert row["epsilon"] <= 8.0 * (1 + 1e-3)


def recomputed_epsilon(r: dict) -> float:
    """A tuned arm of a rule with one sampled Gaussian per round (automatic, fixed)."""
    sel = r["selection"]
    return selected_then_trained_epsilon(
        r["clients_per_round"] / r["clients"], r["rounds_requested"],
        r["candidate_noise_multiplier"], sel["mean_runs"], sel["shape"], r["noise_multiplier"],
        1e-5,
    )  # fmt: skip


def _synthetic_protocol_runs(memo_rounds: list[dict] | None = None) -> list[dict]:
    """A fixed run, a voted DP-LAC run (first round 55 s cumulative, second 60 s), a DP-LAC run
    whose vote came from the memo (its rounds `memo_rounds`, default the voted run's) and a
    tuned automatic arm of 2 candidates."""
    rounds = [{"cpu_seconds": 55.0}, {"cpu_seconds": 60.0}]
    return [
        {"method": "fixed", "cpu_seconds": 100.0},
        {"method": "lac", "c_star": 1, "cpu_seconds": 200.0, "rounds": rounds},
        {"method": "lac", "c_star": 1, "cpu_seconds": 150.0, "rounds": memo_rounds or rounds,
         "vote_from_memo": True},
        {"method": "automatic", "tuned": True, "tuning_runs": 2, "tuning_cpu_seconds": 160.0,
         "cpu_seconds": 90.0},
    ]  # fmt: skip


def test_protocol_cost_counts_every_run_of_the_protocol():
    """Synthetic rows: 24 plain runs + 1 reference at 100 s; 12 voted runs at 150 s without
    their vote + 4 votes at 50 s (first round 55 s cumulative, second 60 s); 12 tuned arms of
    3 candidates at 80 s and a final at 90 s."""
    bench = _benchmark()
    runs = _synthetic_protocol_runs(memo_rounds=[{"cpu_seconds": 5.0}, {"cpu_seconds": 10.0}])
    text = "\n".join(bench.protocol_cost(runs))
    total = 25 * 100 + 12 * 150 + 4 * 50 + 36 * 80 + 12 * 90
    assert f"**{total / 3600:.2f}**" in text
    assert f"{(total + 8 * 50) / 3600:.2f} CPU-hours" in text
    assert "not made" in "\n".join(bench.protocol_cost(runs[:2]))


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--fixed-clip", "0.5"],  # every rule, not the fixed one only
        ["run", "--methods", "fixed", "lac", "--fixed-clip", "0.5"],
        ["run", "--methods", "fixed", "--tune", "automatic", "--fixed-clip", "0.5"],
        ["run", "--methods", "fixed", "--fixed-clip", "0.5"],  # the protocol's own --name
        ["run", "--methods", "fixed", "--fixed-clip", "0", "--name", "sweep"],
    ],
)
def test_fixed_clip_refuses_anything_but_a_fixed_rule_sweep_in_its_own_name(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _benchmark().main(argv)
    assert "--fixed-clip" in str(e.value) and "\n" not in str(e.value)


def test_fixed_clip_sets_the_fixed_rules_clip_norm(small):
    bench, args, task, engine, val, test, _ = small
    row = bench.one_run("fixed", 8.0, 0, args, task, engine, val, test, clip=0.25)
    assert row["initial_clip"] == 0.25
    assert [r["clip_norm"] for r in row["rounds"]] == [0.25] * args.rounds
    assert bench.server_config("fixed", 8.0, 0, args).initial_clip == 1.0  # the protocol's


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--lac-c0", "1", "--name", "novote"],  # every rule, not DP-LAC only
        ["run", "--methods", "lac", "clac", "--lac-c0", "1", "--name", "novote"],
        ["run", "--methods", "lac", "--tune", "automatic", "--lac-c0", "1", "--name", "novote"],
        ["run", "--methods", "lac", "--lac-c0", "1"],  # the protocol's own --name
        ["run", "--methods", "lac", "--lac-c0", "0", "--name", "novote"],
    ],
)
def test_lac_c0_refuses_anything_but_dp_lac_in_its_own_name(argv):
    with pytest.raises(SystemExit) as e:
        _benchmark().main(argv)
    assert "--lac-c0" in str(e.value) and "\n" not in str(e.value)


def test_lac_c0_run_spends_all_of_epsilon_on_the_rounds(small):
    """No vote: C0 as given, no vote counts, and the recorded epsilon is dp-accounting's for
    the rounds alone (the protocol's DP-LAC spends part of it on the vote)."""
    from accounting_oracle import ADD_REMOVE, direct_epsilon

    bench, args, task, engine, val, test, _ = small
    row = bench.one_run(bench.NOVOTE, 8.0, 0, args, task, engine, val, test, clip=1.0)
    assert row["method"] == bench.NOVOTE and row["initial_clip"] == 1.0
    assert row["vote_counts"] == [] and "c_star" not in row
    q = row["clients_per_round"] / row["clients"]
    rounds = len(row["rounds"])
    want = direct_epsilon(row["noise_multiplier"], q, rounds, 1e-5, ADD_REMOVE, kind="rdp")
    assert row["epsilon"] == pytest.approx(want, rel=1e-6)
    lac = bench.server_config("lac", 8.0, 0, args)
    from dpfit.federated.strategy import DPFedAvgServer

    assert row["noise_multiplier"] < DPFedAvgServer(lac, [np.zeros(2)]).noise_multiplier


SETTING = {"rounds_requested": 30, "clients": 1000, "clients_per_round": 100.0,
           "local_optimizer": "sgd", "lr": 0.5}  # fmt: skip


def _row(method: str, seed: int, acc: float, **kw) -> dict:
    return {"method": method, "epsilon_target": 8.0, "seed": seed, "initial_clip": 1.0,
            "test_accuracy": acc, "noise_multiplier": 1.0, "epsilon": 8.0, **SETTING, **kw}  # fmt: skip


def test_novote_section_pairs_by_seed_and_states_the_measured_sign():
    bench = _benchmark()
    lac = [_row("lac", s, a) for s, a in enumerate((0.70, 0.66, 0.69))]
    fixed = [_row("fixed", s, a) for s, a in enumerate((0.60, 0.61, 0.62))]
    novote = [_row(bench.NOVOTE, s, a) for s, a in enumerate((0.65, 0.64, 0.66))]
    text = "\n".join(bench.novote_section(lac + fixed, novote))
    for title, d in (
        ("DP-LAC (vote) minus no vote", [0.05, 0.02, 0.03]),
        ("no vote minus fixed C = 1", [0.05, 0.03, 0.04]),
    ):
        mean, lo, hi = bench.paired_interval(d)
        verdict = bench.interval_verdict(lo, hi)
        assert f"eps 8, {title}: {mean:+.4f} [{lo:+.4f}, {hi:+.4f}] (n=3): {verdict} 0" in text
    assert "C0 = 1 in 3 of the 3 paired DP-LAC runs" in text
    assert "--lac-c0 1 --epsilons 8 --seeds 0 1 2" in text


def test_retimed_estimate_prices_each_component_from_its_retimed_runs():
    """The synthetic protocol of test_protocol_cost...; re-timed: a plain run at 60 s, a
    DP-LAC run of 130 s whose vote took 30 s (first round 35 s, second 40 s), a reference at
    50 s and two no-vote runs at 90 s and 110 s; tuning priced at recorded x 0.8."""
    bench = _benchmark()
    runs = _synthetic_protocol_runs()
    for r in runs:
        r.update(epsilon_target=8.0, seed=0, initial_clip=1.0, test_accuracy=0.7, test_loss=0.5,
                 test_examples=1264, **SETTING)  # fmt: skip
    retimed = [
        dict(runs[0], cpu_seconds=60.0),
        dict(runs[1], cpu_seconds=130.0, rounds=[{"cpu_seconds": 35.0}, {"cpu_seconds": 40.0}]),
        dict(runs[0], method=bench.NON_PRIVATE, cpu_seconds=50.0),
    ]
    novote = [{"cpu_seconds": 90.0}, {"cpu_seconds": 110.0}]
    text = "\n".join(bench.retimed_cost(runs, retimed, novote, {"ratio": 0.8, "command": "c"}))
    read = 2 * 55.0 - 60.0  # the recorded read-back vote's price: no engine work
    total = 24 * 60 + 50 + 12 * 100 + 4 * 30 + 8 * read + 36 * 80 * 0.8 + 12 * 90 * 0.8
    assert f"**{total / 3600:.2f}**" in text
    assert "recorded x 0.80 (not re-timed)" in text
    # a re-timed tuned arm (2 candidates in 100 s, final run 70 s) prices both tuning parts
    tuned = dict(runs[3], tuning_runs=2, tuning_cpu_seconds=100.0, cpu_seconds=70.0)
    text = "\n".join(
        bench.retimed_cost(runs, [*retimed, tuned], novote, {"ratio": 0.8, "command": "c"})
    )
    total += 36 * (50 - 80 * 0.8) + 12 * (70 - 90 * 0.8)
    assert f"**{total / 3600:.2f}**" in text and "not re-timed" not in text


def test_reproduction_pairs_each_cell_with_the_first_run():
    """A re-run against the first run: cells paired by (arm, epsilon, seed), an accuracy that
    moved by under half a test example counted as the same, C_0 compared for the voting rules,
    and the CPU ratio over untuned runs without a vote only."""
    bench = _benchmark()
    n = 1264
    vote = {"c_star": 1.0, "rounds": [{"clip_norm": 1.0}]}
    first = [
        _row("fixed", 0, 0.70, test_examples=n, cpu_seconds=100.0, load_avg=4.0),
        _row("fixed", 1, 0.60, test_examples=n, cpu_seconds=120.0, load_avg=4.0),
        _row("lac", 0, 0.65, test_examples=n, cpu_seconds=300.0, **vote),
        _row("lac", 1, 0.66, test_examples=n, cpu_seconds=300.0, **vote),
    ]
    rerun = [
        _row("fixed", 0, 0.70, test_examples=n, cpu_seconds=80.0, load_avg=2.0),
        _row("fixed", 1, 0.60 + 2 / n, test_examples=n, cpu_seconds=90.0, load_avg=2.0),
        _row("lac", 0, 0.65, test_examples=n, cpu_seconds=30.0, **vote),
        _row(
            "lac",
            1,
            0.66,
            test_examples=n,
            cpu_seconds=30.0,
            c_star=1.0,
            rounds=[{"clip_norm": 0.5}],
        ),  # fmt: skip
        _row("dynamic", 0, 0.5, test_examples=n, cpu_seconds=1.0),  # not in the first run
    ]
    text = "\n".join(bench.reproduction(rerun, first))
    assert "4 cells" in text
    assert (
        f"the same number of correct test predictions in 3 of 4; largest difference {2 / n:+.4f}"
        in text
    )
    assert "the same C_0 in 1 of 2" in text
    assert f"median over 2 pairs: {statistics.median([0.8, 0.75]):.2f}" in text
    assert bench.reproduction(rerun, []) == []

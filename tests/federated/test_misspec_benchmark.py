"""The misspecification protocol's script: its plan, its heterogeneous clients, and the
pre-registered verdict computed from synthetic rows (no model is trained)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("federated_misspec")


def _args(bench, **kw) -> argparse.Namespace:
    base = dict(
        c_inits=list(bench.C_INITS),
        epsilons=list(bench.EPSILONS),
        partitions=list(bench.PROTOCOL_PARTITIONS),
        seeds=list(bench.PROTOCOL_SEEDS),
        methods=list(bench.PROTOCOL_METHODS),
        no_sweep=False,
    )
    return argparse.Namespace(**dict(base, **kw))


def test_the_plan_is_the_registered_protocol(bench):
    # amendment 1: IID, seeds 0-2, lac-2s and lac at 3 C_init + the 7-clip fixed sweep, 2 eps
    plan = bench.plan_runs(_args(bench))
    assert len(plan) == len(set(plan)) == 2 * 3 * (2 * 3 + 7)
    original = _args(
        bench, partitions=list(bench.PARTITIONS), seeds=[0, 1, 2, 3, 4], methods=bench.METHODS
    )
    assert len(bench.plan_runs(original)) == 7 * 3 * 2 * 2 * 5 + 7 * 2 * 2 * 5
    fixed = {k[4] for k in plan if k[0] == "fixed"}
    assert fixed == set(bench.SWEEP) >= set(bench.C_INITS)
    pilot = bench.plan_runs(
        _args(
            bench,
            seeds=[0],
            epsilons=[8.0],
            c_inits=[0.1, 10.0],
            partitions=["iid"],
            methods=["lac-2s", "lac", "fixed"],
            no_sweep=True,
        )
    )
    assert len(pilot) == 6
    assert bench.estimate_cpu_s(pilot, set(pilot), rounds=20) == 0
    assert bench.estimate_cpu_s(pilot, set(), 20) < bench.estimate_cpu_s(pilot, set(), 30)


def test_label_skewed_clients_are_heterogeneous_and_reproducible(bench):
    train = [SimpleNamespace(label=i % 2, text=str(i)) for i in range(2000)]
    a = bench.label_skew_clients(train, 100, 10, 0.3, seed=0)
    b = bench.label_skew_clients(train, 100, 10, 0.3, seed=0)
    assert [[e.text for e in c] for c in a] == [[e.text for e in c] for c in b]
    assert all(len(c) == 10 for c in a)
    pure = sum(len({e.label for e in c}) == 1 for c in a)
    assert pure > 30  # Dirichlet(0.3) over 2 labels: most clients hold mostly one label
    iid_like = bench.label_skew_clients(train, 100, 10, 100.0, seed=0)
    assert sum(len({e.label for e in c}) == 1 for c in iid_like) < 5


def _rows(bench, new_minus_star: float, star: float = 1.0, parts=("iid",)) -> list[dict]:
    """The complete protocol's rows with fixed C* scoring 0.70 (+ seed noise), every other
    clip 0.60, and lac-2s at C* + ``new_minus_star``."""
    rows = []
    for eps in bench.EPSILONS:
        for part in parts:
            for s in bench.PROTOCOL_SEEDS:
                wobble = 0.002 * (s - 1)
                for c in bench.SWEEP:
                    acc = 0.70 + wobble if c == star else 0.60
                    rows.append(
                        dict(
                            method="fixed",
                            epsilon_target=eps,
                            partition=part,
                            seed=s,
                            c_init=c,
                            test_accuracy=acc,
                        )
                    )
                for c in bench.C_INITS:
                    d = new_minus_star + 0.001 * ((s * 7 + int(c * 10)) % 3 - 1)
                    rows.append(
                        dict(
                            method="lac-2s",
                            epsilon_target=eps,
                            partition=part,
                            seed=s,
                            c_init=c,
                            test_accuracy=0.70 + wobble + d,
                        )
                    )
    for r in rows:
        r.update(
            clients=1000,
            clients_per_round=100,
            rounds_requested=30,
            lr=0.5,
            cpu_seconds=1.0,
            initial_clip=r["c_init"],
            rounds=[],
        )
    return rows


def test_c_star_is_the_best_swept_clip(bench):
    rows = _rows(bench, 0.0, star=0.5)
    best, accs = bench.c_star(rows, 8.0, "iid")
    assert best == 0.5 and len(accs) == len(bench.PROTOCOL_SEEDS)


@pytest.mark.parametrize("gap,within", [(0.0, True), (-0.005, True), (-0.02, False)])
def test_the_verdict_reads_the_lower_end_against_one_point(bench, gap, within):
    text = bench.render(_rows(bench, gap), "federated_misspec")
    n = 6 if within else 0
    assert f"{n} of 6 cells within 1 point" in text
    assert "Cell-averaged lac-2s minus C*" in text
    # no lac rows: condition 3 cannot be met, so the default stays
    assert "NOT met): the default stays lac." in text


def test_the_default_changes_only_when_all_three_conditions_hold(bench):
    rows = _rows(bench, 0.0)
    lac = [
        dict(r, method="lac", test_accuracy=r["test_accuracy"] - 0.05)
        for r in rows
        if r["method"] == "lac-2s"
    ]
    text = bench.render(rows + lac, "federated_misspec")
    assert "(conditions 1, 2, 3: met, met, met): lac-2s becomes the --method default." in text
    better_lac = [dict(r, test_accuracy=r["test_accuracy"] + 0.1) for r in lac]
    text = bench.render(rows + better_lac, "federated_misspec")
    assert "met, met, NOT met): the default stays lac." in text


def test_a_partial_protocol_draws_no_verdict(bench):
    rows = [r for r in _rows(bench, 0.0) if r["seed"] < 2]
    text = bench.render(rows, "federated_misspec_pilot")
    assert "no verdict" in text and "PILOT, 2 seed(s), not the protocol" in text
    assert "no verdict" in bench.render(rows, "federated_misspec")


def test_dp_lac_is_reported_against_each_baseline_per_cell_whatever_its_sign(bench):
    rows = _rows(bench, 0.0)
    lac = [
        dict(r, method="lac", test_accuracy=r["test_accuracy"] - 0.05)
        for r in rows
        if r["method"] == "lac-2s"
    ]
    table = bench.baseline_table(rows + lac)
    assert len(table) == 2 + len(bench.C_INITS) * len(bench.EPSILONS)
    # lac is 0.05 below lac-2s (which sits at C*) and fixed at C_init 0.1 / 10 scores 0.60
    row = next(r for r in table if r.startswith("| 8 | iid | 0.1 |"))
    cols = [c.strip() for c in row.strip("|").split("|")]
    means = [float(c.split()[0]) for c in cols[4:]]
    assert cols[3] == "1"
    # lac-2s - C*, lac - C*, lac - fixed at 0.1 (0.65 - 0.60), lac-2s - lac
    assert means == pytest.approx([0.0, -0.05, 0.05, 0.05], abs=0.002)
    text = bench.render(rows + lac, "federated_misspec")
    block = bench.docs_block(rows + lac, text, "federated_misspec")
    assert "lac-2s becomes the --method default." in block and table[2] in block


def test_rules_run_beside_the_decision_rule_get_their_own_per_cell_table(bench):
    rows = _rows(bench, 0.0)
    lac = [dict(r, method="lac", test_accuracy=r["test_accuracy"] - 0.05)
           for r in rows if r["method"] == "lac-2s"]  # fmt: skip
    assert bench.others_table(rows + lac) == []  # nothing run beside: no table
    auto = [dict(r, method="automatic", test_accuracy=r["test_accuracy"] - 0.08)
            for r in rows if r["method"] == "lac-2s"]  # fmt: skip
    table = bench.others_table(rows + lac + auto)
    row = next(r for r in table if r.startswith("| 8 | iid | 0.1 |"))
    cols = [c.strip() for c in row.strip("|").split("|")]
    # automatic's mean, automatic - C*, lac - automatic, lac-2s - automatic
    assert [float(c.split()[0]) for c in cols[3:]] == pytest.approx(
        [0.62, -0.08, 0.03, 0.08], abs=0.003
    )
    assert row in bench.render(rows + lac + auto, "federated_misspec")


def test_the_twelve_cell_verdict_is_drawn_only_when_the_heterogeneous_cells_are_complete(bench):
    iid = _rows(bench, 0.0)
    lac = lambda rows: [dict(r, method="lac", test_accuracy=r["test_accuracy"] - 0.05)  # noqa: E731
                        for r in rows if r["method"] == "lac-2s"]  # fmt: skip
    text = bench.render(iid + lac(iid), "federated_misspec")
    assert "Verdict over the 6 IID cells" in text and "Verdict over the 12 cells" not in text
    # the heterogeneous cells 2 points below C*: all 12 run, 6 of 12 within, so no change
    het = _rows(bench, -0.02, parts=("dirichlet",))
    text = bench.render(iid + lac(iid) + het + lac(het), "federated_misspec")
    twelve = text.split("Verdict over the 12 cells")[1]
    assert "6 of 12 cells within 1 point" in twelve
    assert "NOT met, met): the default stays lac." in twelve
    six = text.split("Verdict over the 12 cells")[0].split("Verdict over the 6 IID cells")[1]
    assert "6 of 6 cells within 1 point" in six and "lac-2s becomes the --method default." in six
    # one heterogeneous seed missing: the 12-cell verdict is not drawn, the 6-cell one stands
    partial = [r for r in het if r["seed"] != 2]
    text = bench.render(iid + lac(iid) + partial + lac(partial), "federated_misspec")
    assert "no verdict" in text.split("Verdict over the 12 cells")[1]
    block = bench.docs_block(iid + partial, text, "federated_misspec")
    assert "**Verdict over the 12 cells" in block and "no verdict" in block


def test_the_seeds_the_one_point_test_needs(bench):
    import statistics

    from harness.stats import pairs_needed, t_interval

    def half_width(k: int, sd: float) -> float:
        raw = [(-1.0) ** i * (1 + i % 3) for i in range(k)]  # any spread, rescaled to sd
        lo, hi = t_interval([x * sd / statistics.stdev(raw) for x in raw])
        return (hi - lo) / 2

    # a spread of 0.013 (lac at C_init = C* = 1, eps 8, in the protocol) needs about 10 pairs
    n = pairs_needed(0.013, 0.01)
    assert 8 <= n <= 12
    assert half_width(n, 0.013) <= 0.01 < half_width(n - 1, 0.013)
    assert pairs_needed(0.0, 0.01) == 2
    text = bench.render(_rows(bench, 0.0), "federated_misspec")
    assert "## How many seeds the 1-point test needs" in text
    line = next(x for x in text.splitlines() if x.startswith("| 8 | iid | 0.1 | lac-2s |"))
    cols = [c.strip() for c in line.strip("|").split("|")]
    assert int(cols[5]) == pairs_needed(float(cols[4]), 0.01)


def test_public_trial_gets_its_own_verdict_beside_lac_2s(bench):
    rows = _rows(bench, -0.05)  # lac-2s 5 points below C*
    trial = [dict(r, method="public-trial", test_accuracy=r["test_accuracy"] + 0.05)
             for r in rows if r["method"] == "lac-2s"]  # fmt: skip
    lac = [dict(r, method="lac", test_accuracy=r["test_accuracy"] - 0.02)
           for r in trial]  # fmt: skip
    text = bench.render(rows + trial + lac, "federated_misspec")
    mine = text.split("Verdict over the 6 IID cells (amendment 1), for public-trial.")[1]
    assert "public-trial becomes the --method default." in mine.split("##")[0]
    theirs = text.split("Verdict over the 6 IID cells (amendment 1).**")[1].split("**")[0]
    assert "the default stays lac." in theirs
    assert "| 8 | iid | 0.1 | public-trial |" in text  # its seeds-needed row

    row = next(x for x in bench.candidate_table(rows + trial + lac, "public-trial")
               if x.startswith("| 2 | iid | 1 |"))  # fmt: skip
    cols = [c.strip() for c in row.strip("|").split("|")]
    # C_0 by seed, public-trial - C*, - lac-2s, - lac
    assert [float(c.split()[0]) for c in cols[4:]] == pytest.approx([0.0, 0.05, 0.02], abs=0.003)
    assert row in text and row in bench.docs_block(rows + trial + lac, text, "federated_misspec")
    assert "`public-trial` (outside the decision rule)" not in text


@pytest.mark.parametrize("name", ["federated_misspec", "federated_misspec_smollm2"])
def test_the_committed_tables_are_the_rendering_of_the_committed_runs(bench, name):
    """No figure in the results or in docs/federated.md's block is typed by hand."""
    runs = [r for r in bench.load_runs(bench.RESULTS / f"{name}.jsonl")
            if r["method"] != bench.NON_PRIVATE]  # fmt: skip
    text = bench.render(runs, name, bench.load_floor(bench.RESULTS))
    assert (bench.RESULTS / f"{name}.md").read_text() == text
    if name == "federated_misspec":
        begin, end = bench.DOCS_MARKERS
        block = bench.DOCS.read_text().split(begin)[1].split(end)[0]
        assert block.strip() == bench.docs_block(runs, text, name).strip()

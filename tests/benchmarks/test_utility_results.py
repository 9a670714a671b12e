"""The committed utility suite: its table is the rendering of its run log, and every private
row's epsilon holds up under an independent accountant."""

from __future__ import annotations

import json
from pathlib import Path

import dp_accounting as dpa
import pytest
from benchmark_scripts import load_benchmark
from dp_accounting import rdp

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# not dp-accounting's default grid (what dpfit uses): a coarser one of our own, which can only
# give a looser (larger) epsilon, so the recorded figure must not exceed it by more than rounding
ORDERS = [2 + x / 4 for x in range(41)] + list(range(13, 65)) + [80, 96, 128, 256]


def _utility():
    return load_benchmark("utility", "utility_bench")


# the CPU machines' runs, the runs on a lent GPU, and the CPU runs with dropout off in bf16
TAGS = ("utility", "utility_gpu", "utility_bf16_dropout0")
# every committed log whose private runs' epsilons are checked (also the first bf16 runs)
LOGS = (*TAGS, "utility_bf16")


def _private_runs() -> list[dict]:
    runs = [
        json.loads(x)
        for tag in LOGS
        for x in (RESULTS / f"{tag}_runs.jsonl").read_text().splitlines()
    ]
    return [r for r in runs if r.get("noise_multiplier") and "accuracy" in r]


def _mechanisms() -> dict[tuple, list[dict]]:
    """Runs grouped by what the accountant sees: (sigma, q, steps, delta, target epsilon)."""
    groups: dict[tuple, list[dict]] = {}
    for r in _private_runs():
        steps = r["steps"] + (r.get("head_first_steps") or 0)
        q = min(r["batch_size"], r["n_train"]) / r["n_train"]
        target = float(r["row"].split("eps=")[1].split(",")[0])
        groups.setdefault((r["noise_multiplier"], q, steps, r["delta"], target), []).append(r)
    return groups


MECHANISMS = _mechanisms()  # read and grouped once, not once per parametrized case


@pytest.mark.parametrize("tag", TAGS)
def test_committed_table_is_rendered_from_the_committed_log(tag):
    """No figure in utility.md is typed by hand: re-rendering the log gives the file."""
    u = _utility()
    payload = json.loads((RESULTS / f"{tag}.json").read_text())
    records = u.read_log(RESULTS / f"{tag}_runs.jsonl")
    scale = u.Scale(None, None)
    assert payload["scale"] == scale.tag()
    md = u.markdown(u.summarize(records, scale), payload["header"], u.failed_runs(records, scale))
    assert md == (RESULTS / f"{tag}.md").read_text()


def test_the_gpu_runs_say_where_they_ran_and_the_docs_quote_them():
    u = _utility()
    records = u.read_log(RESULTS / "utility_gpu_runs.jsonl")
    assert records and all("H200" in r["device"] for r in records)
    assert "runs on NVIDIA H200" in json.loads((RESULTS / "utility_gpu.json").read_text())["header"]
    block = u.modes_block(
        u.summarize(records, u.Scale(None, None)), "benchmarks/results/utility_gpu.md"
    )
    begin, end = u.MODES_DOC_MARKERS
    doc = (ROOT / "docs" / "bias_lora.md").read_text()
    assert doc.split(begin, 1)[1].split(end, 1)[0] == f"\n{block}\n"


def test_the_dropout_off_runs_ran_as_private_runs_train_and_the_docs_quote_them():
    u = _utility()
    records = u.read_log(RESULTS / "utility_bf16_dropout0_runs.jsonl")
    private = [r for r in records if r.get("epsilon") not in (None, float("inf"))]
    assert private and all(r["dropout"] == 0.0 and r["precision"] == "bf16" for r in private)
    block = u.modes_block(
        u.summarize(records, u.Scale(None, None)), "benchmarks/results/utility_bf16_dropout0.md"
    )
    begin, end = u.modes_doc_markers("utility_bf16_dropout0")
    doc = (ROOT / "docs" / "bias_lora.md").read_text()
    assert doc.split(begin, 1)[1].split(end, 1)[0] == f"\n{block}\n"


def test_the_log_has_private_runs_of_every_kind():
    rows = {r["row"] for r in _private_runs()}
    assert {"DP-BiTFiT eps=8", "DP full eps=8", "DP hashed n-gram LR eps=8"} <= rows
    assert {"DP LoRA-only eps=8", "DP bias+LoRA eps=8", "DP bias+LoRA eps=1"} <= rows


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS), ids=str)
def test_each_private_run_spent_what_it_claims(mechanism):
    """(sigma, q = B/n, head-first + main steps) at the run's delta, composed by dp-accounting's
    RDP accountant directly: the recorded epsilon is that figure, within the row's target."""
    sigma, q, steps, delta, target = mechanism
    acc = rdp.RdpAccountant(ORDERS)
    acc.compose(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)
    )
    direct = acc.get_epsilon(delta)
    for run in MECHANISMS[mechanism]:
        assert direct * (1 - 2e-2) <= run["epsilon"] <= direct * (1 + 1e-6), run["key"]
        assert run["epsilon"] <= target * (1 + 1e-3), run["key"]
        assert delta <= min(1e-5, run["n_train"] ** -1.1) * (1 + 1e-9), run["key"]


def test_paired_interval_is_the_one_sample_t_interval_of_the_differences():
    """The LoRA-vs-BiTFiT interval: scipy's one-sample t test on the same differences."""
    from scipy import stats

    u = _utility()
    diffs = [-0.5, 0.5, 1.5, 2.75]
    lo, hi = u.t_interval(diffs)
    ref = stats.ttest_1samp(diffs, 0.0).confidence_interval(0.95)
    assert (lo, hi) == pytest.approx((ref.low, ref.high), rel=1e-12)
    assert u.t_interval([1.0]) is None


def test_the_recipe_freezes_lora_a_exactly_when_the_committed_criterion_is_met():
    """dpfit.recipe.PRIVATE_LORA_FREEZE_A follows the criterion fixed before the FFA-LoRA suite
    runs, on the committed runs (the criterion's logic itself below)."""
    from dpfit.recipe import PRIVATE_LORA_FREEZE_A

    u = _utility()
    summary = u.summarize(
        u.read_log(RESULTS / "utility_bf16_dropout0_runs.jsonl"), u.Scale(None, None)
    )
    verdict = u.ffa_default_verdict(summary)
    assert verdict is not None and PRIVATE_LORA_FREEZE_A == verdict


def test_ffa_default_criterion_logic():
    u = _utility()
    names = {k: u.ROW_BY_KEY[k].name for k in ("dp-bias-ffa-8", "dp-bias-lora-8", "dp-8")}

    def summary(ffa, lora, bitfit, tasks=("rotten-tomatoes", "text-source", "convention-party")):
        rows = lambda: {  # noqa: E731
            names["dp-bias-ffa-8"]: {"by_seed": dict(enumerate(ffa))},
            names["dp-bias-lora-8"]: {"by_seed": dict(enumerate(lora))},
            names["dp-8"]: {"by_seed": dict(enumerate(bitfit))},
        }
        return {t: rows() for t in tasks}

    assert u.ffa_default_verdict(summary([2, 2, 2], [1, 1, 1], [1, 1, 1])) is True
    assert u.ffa_default_verdict(summary([1, 1, 1], [2, 2, 2], [1, 1, 1])) is False  # < lora
    assert u.ffa_default_verdict(summary([0, 0, 0], [0, 0, 0], [1, 1, 1])) is False  # < bitfit
    assert u.ffa_default_verdict(summary([2, 2], [1, 1], [1, 1])) is None  # two seeds
    assert u.ffa_default_verdict(summary([2, 2, 2], [1, 1, 1], [1, 1, 1], ("text-source",))) is None

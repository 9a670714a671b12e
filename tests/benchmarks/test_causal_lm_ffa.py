"""benchmarks/causal_lm_ffa.py: the paired statistics, the criterion, the committed table, the
recipe's causal-LM FFA default against the committed verdict, and every run's epsilon."""

from __future__ import annotations

import json
import math

import dp_accounting as dpa
import pytest
from benchmark_scripts import BENCHMARKS, load_benchmark
from dp_accounting import rdp

from dpfit import recipe as R

ffa = load_benchmark("causal_lm_ffa")
# a grid of our own, coarser than dp-accounting's default: it can only give a larger epsilon
ORDERS = [2 + x / 4 for x in range(41)] + list(range(13, 65)) + [80, 96, 128, 256]


def _rows(ppl: dict[str, list[float]]) -> list[dict]:
    return [
        dict(arm=arm, seed=seed, perplexity_after=p, perplexity_before=30.0, lr=1e-3, steps=24,
             batch=8, max_length=256, train_windows=701, eval_windows=38, epsilon=8.0,
             noise_multiplier=0.4, cpu_s=1.0)
        for arm, values in ppl.items()
        for seed, p in enumerate(values)
    ]  # fmt: skip


def _committed() -> list[dict]:
    path = BENCHMARKS / "results" / "causal_lm_ffa.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_paired_differences_and_t_interval_written_out():
    rows = _rows({"bias+ffa": [20.0, 21.0, 22.5], "bias+lora": [20.5, 21.0, 22.0]})
    d, mean, half = ffa.paired(rows, "bias+ffa", "bias+lora")
    assert d == [-0.5, 0.0, 0.5] and mean == 0.0
    # t(0.975) with 2 degrees of freedom in closed form, (2p - 1) sqrt(2 / (4 p (1 - p)));
    # sd of the differences 0.5, 3 pairs
    t975 = 0.95 * math.sqrt(2 / (4 * 0.975 * 0.025))
    assert half == pytest.approx(t975 * 0.5 / math.sqrt(3), rel=1e-9)
    assert ffa.paired(rows, "bias+ffa", "bias") is None


def test_the_criterion_needs_three_paired_seeds_and_a_mean_at_or_below_zero():
    assert ffa.verdict(_rows({"bias+ffa": [20.0, 20.0], "bias+lora": [21.0, 21.0]})) is None
    assert ffa.verdict(_rows({"bias+ffa": [20.0, 21.0, 22.0], "bias+lora": [20.0, 21.0, 22.0]}))
    win = _rows({"bias+ffa": [20.0, 21.0, 22.0], "bias+lora": [20.1, 21.0, 22.0]})
    assert ffa.verdict(win) == "stands"
    lose = _rows({"bias+ffa": [20.2, 21.0, 22.0], "bias+lora": [20.1, 21.0, 22.0]})
    assert ffa.verdict(lose) == "limited to classification"


def test_committed_table_is_the_rendering_of_the_committed_runs():
    md = (BENCHMARKS / "results" / "causal_lm_ffa.md").read_text()
    assert md == ffa.render(_committed())


def test_the_recipe_follows_the_committed_verdict_for_causal_lms():
    """The private bias+lora default for a causal LM is what the measured criterion says."""
    v = ffa.verdict(_committed())
    assert v is not None, "the committed runs decide the criterion"
    freeze = R.default_lora_freeze_a(True, "bias+lora", language_model=True)
    assert freeze == (v == "stands")
    assert R.default_lora_freeze_a(True, "bias+lora") is R.PRIVATE_LORA_FREEZE_A


def test_the_runs_trained_what_their_arm_says():
    for r in _committed():
        mode, freeze = ffa.ARMS[r["arm"]]
        assert r["mode"] == mode
        assert r["lora_freeze_a"] is (bool(freeze) if mode == "bias+lora" else False)
    by = {r["arm"]: r["trainable_params"] for r in _committed()}
    assert by["bias"] < by["bias+ffa"] < by["bias+lora"]


def test_each_run_spent_what_it_claims():
    """(sigma, q, steps) at the run's delta through dp-accounting's RDP accountant directly."""
    for r in _committed():
        acc = rdp.RdpAccountant(ORDERS)
        step = dpa.PoissonSampledDpEvent(
            r["sample_rate"], dpa.GaussianDpEvent(r["noise_multiplier"])
        )
        acc.compose(dpa.SelfComposedDpEvent(step, r["steps"]))
        direct = acc.get_epsilon(r["delta"])
        assert direct * (1 - 2e-2) <= r["epsilon"] <= direct * (1 + 1e-6), r["command"]
        assert r["epsilon"] <= ffa.EPSILON * (1 + 1e-3)


def test_the_docs_block_is_the_rendering_of_the_committed_runs():
    begin, end = ffa.DOC_MARKERS
    doc = (BENCHMARKS.parent / "docs" / "bias_lora.md").read_text()
    assert doc.split(begin, 1)[1].split(end, 1)[0] == f"\n{ffa.doc_block(_committed())}\n"

"""The from-checkpoint rule's constant (dpfit.recipe.TRAINED_WALK) is what the validation
runs of benchmarks/checkpoint_recipe.py choose, by a criterion that never reads the test split."""

from __future__ import annotations

import json

from benchmark_scripts import BENCHMARKS, load_benchmark

from dpfit import recipe as R

cr = load_benchmark("checkpoint_recipe")


def _runs(gaps: dict[str, list[float]], split: str = "val", first_seed: int = 0) -> list[dict]:
    """Runs of every task and row per variant, end - start as given (one entry a seed)."""
    return [
        dict(kind="train", task=task, row=row, variant=variant, seed=seed, split=split,
             start_accuracy=0.8, accuracy=0.8 + gap)
        for variant, per_seed in gaps.items()
        for seed, gap in enumerate(per_seed, start=first_seed)
        for task in cr.TASKS
        for row in cr.ROWS
    ]  # fmt: skip


def _committed() -> list[dict]:
    text = (BENCHMARKS / "results" / "checkpoint_recipe.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_trained_walk_is_the_committed_validation_choice():
    """Changing the constant without new validation runs that choose it fails here."""
    _, chosen, _ = cr._choice([r for r in _committed() if r.get("kind") == "train"])
    assert chosen is not None
    k = cr.WALK_SCALE[chosen]
    assert R.TRAINED_WALK["full"] == cr.REF_WALK["full"] * k
    assert R.TRAINED_WALK["bias"] == cr.REF_WALK["bias"] * k
    # language models keep their own distances (measured on language models, not here)
    assert R.LM_WALK != {m: R.TRAINED_WALK[m] for m in R.LM_WALK}


def test_the_choice_is_the_largest_walk_that_meets_the_target_everywhere():
    # walk/3 loses beyond its spread, walk/10 within it (mean -0.001, sd of the end 0.0017)
    runs = _runs({"walk/3": [-0.02, -0.021, -0.019], "walk/10": [0.0, -0.003, 0.0]})
    assert cr._choice(runs)[1] == "walk/10"
    # one row of walk/10 below its start in every seed: missed; walk/30 not run: no choice
    for r in runs:
        if (r["variant"], r["task"], r["row"]) == ("walk/10", "fmnist-5k", "1+bitfit"):
            r["accuracy"] = r["start_accuracy"] - 0.01
    assert cr._choice(runs)[1] is None
    assert cr._choice(runs + _runs({"walk/30": [0.0, 0.0, 0.0]}))[1] == "walk/30"


def test_a_larger_candidate_with_too_few_seeds_leaves_no_choice_and_test_rows_do_not_count():
    two_seeds = _runs({"walk/3": [0.01, 0.01], "walk/10": [0.0, 0.0, 0.0]})
    assert cr._choice(two_seeds)[1] is None
    third = {"walk/3": [0.01]}
    assert cr._choice(two_seeds + _runs(third, first_seed=2))[1] == "walk/3"
    assert cr._choice(two_seeds + _runs(third, split="test", first_seed=2))[1] is None


def test_the_results_and_the_docs_are_the_scripts_rendering_of_the_committed_runs():
    md, block = cr.render(_committed())
    assert (BENCHMARKS / "results" / "checkpoint_recipe.md").read_text() == md
    begin, end = cr.DOC_MARKERS
    doc = (BENCHMARKS.parent / "docs" / "vision.md").read_text()
    assert doc.split(begin, 1)[1].split(end, 1)[0] == f"\n{block}\n"
    assert ": the choice." in block  # the recipe runs with what validation chose

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


def test_mcnemar_p_is_the_exact_two_sided_sign_test_on_the_changed_images():
    assert cr.mcnemar_p(0, 0) == 1.0
    assert cr.mcnemar_p(3, 3) == 1.0
    # 5 lost, 0 gained: 2 * (1/2)^5
    assert abs(cr.mcnemar_p(5, 0) - 2 / 32) < 1e-15
    assert cr.mcnemar_p(0, 5) == cr.mcnemar_p(5, 0)
    # 1 lost of 6 changed: 2 * (1 + 6) / 64, from the binomial terms written out
    assert abs(cr.mcnemar_p(1, 5) - 14 / 64) < 1e-15
    assert cr.mcnemar_p(20, 0) < 1e-5


def test_flips_counts_images_lost_and_gained_between_two_saved_models(tmp_path):
    """Image by image against the labels: the count of images right at the end equals what
    evaluate_images scores, and lost - gained is correct_start - correct_end."""
    import numpy as np

    from dpfit.tasks.image_classification import evaluate_images
    from dpfit.vision.data import load_images
    from dpfit.vision.models import build_model, save_image_model

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(40, 8, 8), dtype=np.uint8)
    labels = rng.integers(0, 3, size=40)
    data_path = tmp_path / "eval.npz"
    np.savez(data_path, images=images, labels=labels, label_names=np.array(["a", "b", "c"]))
    dirs = []
    for seed in (0, 1):
        model = build_model("resnet-gn", ["a", "b", "c"], in_channels=1, image_size=8, seed=seed)
        save_image_model(model, tmp_path / f"m{seed}")
        dirs.append(tmp_path / f"m{seed}")
    got = cr.flips(dirs[0], dirs[1], str(data_path))
    assert got["correct_start"] - got["correct_end"] == got["lost"] - got["gained"]
    assert got["lost"] + got["gained"] > 0  # two random models differ somewhere
    from dpfit.vision.models import load_image_model

    end = load_image_model(dirs[1])
    data = load_images(str(data_path), "train", end.spec.label_names, image_size=8, channels=1)
    assert got["correct_end"] == round(evaluate_images(end, data)["accuracy"] * 40)
    same = cr.flips(dirs[0], dirs[0], str(data_path))
    assert same["lost"] == same["gained"] == 0


def test_test_rows_from_an_earlier_checkpoint_are_superseded_not_the_verdict():
    lr = R.TRAINED_WALK["full"] / 30**0.5  # the defaults' walk over 30 steps
    base = dict(kind="train", task="fmnist-5k", row="dp-full", variant="default", split="test",
                start_accuracy=0.8, eval_n=2000, train_examples=5000, lr=lr, full_lr=None,
                steps=30, batch_size=500, train_cpu_s=1.0)  # fmt: skip
    assert cr._walks(base) == cr._planned_walks("fmnist-5k", "dp-full", "default", {"train": {}})
    old = [dict(base, seed=s, accuracy=0.79, finished="2026-01-01") for s in range(3)]
    new = [dict(base, seed=s, accuracy=0.8, finished="2026-02-01", checkpoint="abc",
                flips={"lost": 1, "gained": 1, "correct_start": 1600, "correct_end": 1600})
           for s in range(3)]  # fmt: skip
    md, block = cr.render(old + new)
    assert "default (earlier checkpoint)" in md
    verdict = md.split("Target (test split")[1].split("Superseded")[0]
    assert "checkpoint abc" in verdict and "met" in verdict and "missed" not in verdict
    assert "1 / 1 (1.00)" in block
    assert cr._latest_checkpoints(old + new) == {"fmnist-5k": "abc"}

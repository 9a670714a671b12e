"""The recipe: a pure function of public quantities, and what the run actually uses."""

import dataclasses
import random

import pytest

from dpfit import recipe as R
from dpfit.models import save_tiny_random_model
from dpfit.recipe import Recipe, default_delta, resolve_recipe
from dpfit.train import TrainConfig, train


def test_pure_and_equal_sizes_give_equal_recipes():
    args = (10_233, 2, 8.0, 1e-5, 22_700_000)
    assert resolve_recipe(*args) == resolve_recipe(*args)
    assert isinstance(resolve_recipe(*args), Recipe)
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolve_recipe(*args).lr = 1.0  # type: ignore[misc]


def test_private_rule_follows_its_constants():
    r = resolve_recipe(10_000, 2, 8.0, 1e-5, 22_700_000)
    b = round(R.BATCH_PER_SQRT_N * 100)
    assert r.batch_size == b
    steps_per_epoch = round(10_000 / b)
    assert r.epochs * steps_per_epoch >= R.MIN_STEPS or r.epochs == R.MAX_EPOCHS
    assert (r.epochs - 1) * steps_per_epoch < R.MIN_STEPS or r.epochs == R.MIN_EPOCHS
    assert r.clipping == R.PRIVATE_CLIPPING and r.lr == R.PRIVATE_LR["bias"]
    assert resolve_recipe(10_000, 2, 8.0, 1e-5, 22_700_000, "full").lr == R.PRIVATE_LR["full"]
    np = resolve_recipe(10_000, 2, 8.0, 1e-5, 22_700_000, private=False)
    assert np.clipping is None and np.batch_size == R.NON_PRIVATE_BATCH
    # LP-FT: the non-private reference in bias mode starts with the head too, at its own lr
    assert np.head_epochs == R.NON_PRIVATE_HEAD_EPOCHS and np.head_lr == R.NON_PRIVATE_HEAD_LR
    # non-private full too: from a zero head it lost to the frozen probe on text-source (74.2
    # against 75.2), with the head first it reached 82.8
    npf = resolve_recipe(10_000, 2, 8.0, 1e-5, 22_700_000, "full", private=False)
    assert npf.head_epochs == R.NON_PRIVATE_HEAD_EPOCHS and npf.lr == R.NON_PRIVATE_LR["full"]
    # private full mode starts from a private probe too: DP full eps 8 from a zero head ended
    # at the majority class on the utility suite's convention-party task
    assert resolve_recipe(10_000, 2, 8.0, 1e-5, 22_700_000, "full").head_epochs > 0
    assert resolve_recipe(10_000, 2, 8.0, 1e-5, 1, private=False, head_first=False).head_epochs == 0
    # small data: a few steps per epoch at least, never a batch above n
    for n in (1, 7, 50, 180, 784):
        r = resolve_recipe(n, 3, 8.0, 1e-5, 10_000)
        assert 1 <= r.batch_size <= n and r.physical_batch_size <= r.batch_size
        assert R.MIN_EPOCHS <= r.epochs <= R.MAX_EPOCHS


def test_delta_rule():
    assert default_delta(100) == default_delta(10_000) == 1e-5
    assert default_delta(10**6) == pytest.approx(10**-6.6)
    assert all(default_delta(n) < 1 / n for n in (2, 10, 1000, 10**6))


def _csv(path, rows):
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows(rows)
    return str(path)


def test_training_data_content_does_not_change_the_recipe(tmp_path):
    """Same size, other texts and labels (permuted, different lengths): the run's recipe,
    and so every hyper-parameter, is the same. Fails if any default reads the data."""
    model = str(save_tiny_random_model(tmp_path / "m"))
    rng = random.Random(0)
    words = "good bad great awful fine poor nice terrible dull fun boring superb".split()
    a = [(" ".join(rng.choices(words, k=3)), rng.choice("xy")) for _ in range(100)]
    a += [("the film", "x")] * 25 + [("the plot", "y")] * 25
    texts = [t for t, _ in a]
    labels = [y for _, y in a]
    rng.shuffle(labels)
    b = [(" ".join(rng.choices(words, k=rng.randint(1, 20))), y) for y in labels]
    results = []
    for name, rows in (("a", a), ("b", b), ("c", list(zip(reversed(texts), labels, strict=True)))):
        res = train(
            TrainConfig(model=model, data=_csv(tmp_path / f"{name}.csv", rows),
                        eval_data=_csv(tmp_path / f"{name}_eval.csv", rows[:10]), max_steps=1)
        )  # fmt: skip
        results.append(res.metrics)
    recipes = [m["recipe"] for m in results]
    assert recipes[0] == recipes[1] == recipes[2]
    expected = resolve_recipe(150, 2, 8.0, default_delta(150), results[0]["total_params"])
    assert recipes[0] == expected.as_dict()
    # ...and it is what ran (the max length lowered to what the model reads: public too)
    from transformers import AutoConfig

    positions = AutoConfig.from_pretrained(model).max_position_embeddings
    m = results[0]
    assert (m["batch_size"], m["epochs"], m["lr"], m["max_length"]) == (
        expected.batch_size, expected.epochs, expected.lr, min(expected.max_length, positions),
    )  # fmt: skip
    assert (m["clipping"], m["max_grad_norm"]) == (expected.clipping, expected.max_grad_norm)
    assert m["sample_rate"] == pytest.approx(expected.batch_size / 150)


def test_flags_override_the_recipe(tmp_path):
    model = str(save_tiny_random_model(tmp_path / "m"))
    rows = [("the film was good", "x"), ("the film was bad", "y")] * 40
    res = train(
        TrainConfig(model=model, data=_csv(tmp_path / "d.csv", rows), max_steps=1,
                    batch_size=12, lr=0.02, clipping="flat", max_grad_norm=3.0)
    )  # fmt: skip
    m = res.metrics
    assert (m["batch_size"], m["lr"], m["clipping"], m["max_grad_norm"]) == (12, 0.02, "flat", 3.0)
    assert set(m["overridden_by_flags"]) == {"batch_size", "lr", "clipping", "max_grad_norm"}
    assert m["recipe"]["batch_size"] != 12

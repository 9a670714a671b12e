"""The recipe: a pure function of public quantities, and what the run actually uses."""

import dataclasses
import random
import re

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


# -- the start: a fresh backbone or a checkpoint already trained for the task ----------------


def test_trained_start_has_smaller_rates_by_the_walk_rule_and_no_head_first():
    args = (10_000, 2, 8.0, 1e-5, 22_700_000)
    fresh = resolve_recipe(*args)
    trained = resolve_recipe(*args, start="trained")
    assert fresh.start == "pretrained" and trained.start == "trained"
    assert fresh.head_epochs > 0 and trained.head_epochs == 0  # the head is already trained
    steps = trained.epochs * round(10_000 / trained.batch_size)
    assert (trained.batch_size, trained.epochs) == (fresh.batch_size, fresh.epochs)
    # the noise walk lr sqrt(T) is the constant of the rule, for each group
    assert trained.lr * steps**0.5 == pytest.approx(R.TRAINED_WALK["bias"])
    full = resolve_recipe(*args, "full", start="trained")
    assert full.lr * steps**0.5 == pytest.approx(R.TRAINED_WALK["full"])
    assert full.lr < trained.lr < fresh.lr and full.lr < R.PRIVATE_LR["full"]
    # asked for explicitly, the probe still runs
    assert resolve_recipe(*args, start="trained", head_first=True).head_epochs > 0
    assert resolve_recipe(*args, private=False, start="trained").head_epochs == 0
    with pytest.raises(ValueError, match="start must be one of"):
        resolve_recipe(*args, start="finetuned")


def test_language_modelling_takes_the_walk_rate_and_classification_keeps_its_own():
    """No new head: a pretrained LM already does its task, so its rate is the trained
    start's noise walk over the steps, far below the fresh backbone's (which raised held-out
    perplexity even with the noise off); a classifier of the same n keeps 5e-3."""
    for n in (171, 701, 10_000):
        lm = resolve_recipe(n, 0, 8.0, 1e-5, 134_705_664)
        steps = lm.epochs * round(n / lm.batch_size)
        assert lm.language_model and lm.start == "pretrained" and lm.head_epochs == 0
        assert lm.lr * steps**0.5 == pytest.approx(R.LM_WALK["bias"])
        assert lm.lr < R.PRIVATE_LR["bias"] / 5
        assert "a pretrained language model already does its task" in lm.describe()
        assert "a pretrained language model" in lm.rule
        # from an LM checkpoint trained for the task: the same LM walk, not the image-chosen one
        trained_lm = resolve_recipe(n, 0, 8.0, 1e-5, 134_705_664, start="trained")
        assert trained_lm.lr == pytest.approx(lm.lr)
        cls = resolve_recipe(n, 2, 8.0, 1e-5, 134_705_664)
        assert not cls.language_model and cls.lr == R.PRIVATE_LR["bias"]
        assert (cls.batch_size, cls.epochs) == (lm.batch_size, lm.epochs)
        assert "language model" not in cls.describe()


def test_a_phase_that_trains_every_weight_never_gets_the_biases_rate():
    for start in R.STARTS:
        r = resolve_recipe(10_000, 10, 8.0, 1e-5, 77_754, full_epochs=1, start=start)
        assert r.full_epochs == 1 and r.full_lr is not None and r.full_lr < r.lr
        full = resolve_recipe(10_000, 10, 8.0, 1e-5, 77_754, "full", start=start)
        bias = resolve_recipe(10_000, 10, 8.0, 1e-5, 77_754, "bias", start=start)
        assert full.lr < bias.lr and full.full_lr is None
    r = resolve_recipe(10_000, 10, 8.0, 1e-5, 77_754, full_epochs=1)
    assert r.full_lr == R.PRIVATE_LR["full"] and r.lr == R.PRIVATE_LR["bias"]
    t = resolve_recipe(10_000, 10, 8.0, 1e-5, 77_754, full_epochs=1, start="trained")
    per_epoch = round(10_000 / t.batch_size)
    assert t.full_lr == pytest.approx(R.TRAINED_WALK["full"] / per_epoch**0.5)
    assert t.lr == pytest.approx(R.TRAINED_WALK["bias"] / ((t.epochs - 1) * per_epoch) ** 0.5)


def test_describe_shows_only_what_applies():
    text = resolve_recipe(10_000, 2, 8.0, 1e-5, 22_700_000).describe()
    assert "max length 128" in text and "head-first" in text and "full epoch" not in text
    assert "trained" not in text and "automatic clipping" in text
    image = resolve_recipe(54_000, 10, 8.0, 1e-5, 77_754, "full", tokens=False, start="trained")
    line = image.describe()
    assert image.max_length is None
    assert "max length" not in line and "token" not in line and "no head-first" in line
    assert not re.search(r"head-first \d+ epochs", line)
    assert "from a checkpoint trained for the task" in line and "every weight" in line
    assert f"lr {image.lr:.3g}" in line
    two = resolve_recipe(54_000, 10, 8.0, 1e-5, 77_754, tokens=False, full_epochs=1)
    assert "1 full epoch at lr 0.0005 then 2 epochs of biases + head at lr 0.005" in two.describe()
    plain = resolve_recipe(1_000, 2, None, None, 1, private=False, head_first=False).describe()
    assert "clipping" not in plain and "head-first" not in plain


def _rows(n: int = 80):
    return [("the film was good", "x"), ("the film was bad", "y")] * (n // 2)


def test_a_dpfit_save_is_detected_as_a_trained_start(tmp_path):
    """Detection reads the checkpoint (its head and classes), not the data: the same data
    gives the trained rule from a dpfit save with its classes, the fresh one otherwise."""
    model = str(save_tiny_random_model(tmp_path / "m"))
    data = _csv(tmp_path / "d.csv", _rows())
    first = train(TrainConfig(model=model, data=data, max_steps=1, output=str(tmp_path / "a")))
    assert first.metrics["recipe"]["start"] == "pretrained"
    assert first.metrics["head_first_steps"] > 0
    again = train(TrainConfig(model=str(tmp_path / "a" / "model"), data=data, max_steps=1))
    m = again.metrics
    assert m["recipe"]["start"] == "trained" and "start_accuracy" in m
    assert m["head_first_steps"] == 0 and m["recipe"]["head_epochs"] == 0
    assert m["lr"] == m["recipe"]["lr"] < R.PRIVATE_LR["bias"]
    assert any("from a checkpoint trained for the task" in n for n in again.notes)
    # other classes: a new head, so a fresh start
    other = _csv(tmp_path / "o.csv", [(t, {"x": "p", "y": "q"}[y]) for t, y in _rows()])
    new = train(TrainConfig(model=str(tmp_path / "a" / "model"), data=other, max_steps=1))
    assert new.metrics["recipe"]["start"] == "pretrained"


def test_two_phase_runs_each_phase_at_its_own_rate(tmp_path, monkeypatch):
    """X+BiTFiT: the full epochs step at full_lr (every weight), the bias epochs at lr."""
    import torch

    seen: list[tuple[int, float]] = []
    step = torch.optim.AdamW.step

    def spy(self, *a, **k):
        seen.append((sum(len(g["params"]) for g in self.param_groups), self.param_groups[0]["lr"]))
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    model = str(save_tiny_random_model(tmp_path / "m"))
    res = train(
        TrainConfig(model=model, data=_csv(tmp_path / "d.csv", _rows()), epochs=2, full_epochs=1)
    )
    m = res.metrics
    assert m["full_lr"] == R.PRIVATE_LR["full"] and m["lr"] == R.PRIVATE_LR["bias"]
    most = max(k for k, _ in seen)  # the full phase steps every tensor, the bias phase fewer
    full = [lr for k, lr in seen if k == most]
    bias = [lr for k, lr in seen if k < most]
    assert full and bias and set(full) == {m["full_lr"]} and set(bias) == {m["lr"]}
    assert seen[: len(full)] == [(most, m["full_lr"])] * len(full)  # full first, then bias
    with pytest.raises(Exception, match="--full-lr is the rate of the --full-epochs phase"):
        train(TrainConfig(model=model, data=_csv(tmp_path / "e.csv", _rows()), full_lr=1e-4))


def test_dropout_is_off_when_private_and_the_models_own_otherwise():
    assert R.default_dropout(True) == R.PRIVATE_DROPOUT == 0.0
    assert R.default_dropout(False) == "model"
    assert R.default_dropout(True, tokens=False) == "model"  # image models: dpfit's have none
    private = resolve_recipe(10_000, 2, 8.0, 1e-5, 22_700_000)
    assert "dropout off" in private.describe()
    ref = resolve_recipe(10_000, 2, None, None, 22_700_000, private=False)
    assert "dropout" not in ref.describe()
    assert "dropout 0.2" in dataclasses.replace(private, dropout=0.2).describe()


def test_private_bias_lora_freezes_lora_a_and_nothing_else_does():
    assert R.PRIVATE_LORA_FREEZE_A is True
    assert R.default_lora_freeze_a(True, "bias+lora")
    for private, mode in [(True, "lora"), (False, "bias+lora"), (False, "lora"), (True, "bias")]:
        assert not R.default_lora_freeze_a(private, mode), (private, mode)
    private = resolve_recipe(10_000, 2, 8.0, 1e-5, 22_700_000, "bias+lora")
    assert private.lora_freeze_a and "biases + LoRA B (A frozen) + head" in private.describe()
    ref = resolve_recipe(10_000, 2, None, None, 22_700_000, "bias+lora", private=False)
    assert not ref.lora_freeze_a and "biases + LoRA + head" in ref.describe()
    # a language model (no classes) takes its own constant
    lm = resolve_recipe(701, 0, 8.0, 1e-5, 135_000_000, "bias+lora")
    assert lm.lora_freeze_a is R.PRIVATE_LM_LORA_FREEZE_A
    assert R.default_lora_freeze_a(True, "bias+lora", language_model=True) is (
        R.PRIVATE_LM_LORA_FREEZE_A
    )

"""dpfit train --tune: the private selection's epsilon, K's draw, the validation split, the run."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import dp_accounting
import numpy as np
import pytest
from accounting_oracle import selected_epsilon

from dpfit.data.text import LabeledTexts
from dpfit.run import tune as tune_mod
from dpfit.run.config import TrainConfig, TrainResult
from dpfit.selection import RunCount, draw_runs, select_best, tnb_gamma

DELTA = 1e-5


def _curve(z: float, q: float, steps: int) -> np.ndarray:
    """dp-accounting alone: the RDP curve of `steps` Poisson-sampled Gaussian steps."""
    acc = dp_accounting.rdp.RdpAccountant()
    step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    acc.compose(dp_accounting.SelfComposedDpEvent(step, steps))
    return np.asarray(acc._rdp)


@pytest.fixture(scope="module")
def plan():
    points = tune_mod.grid(0.005, 4)
    return tune_mod.plan(points, head_steps=8, steps_per_epoch=5, sample_rate=0.1,
                         target_epsilon=4.0, delta=DELTA)  # fmt: skip


def test_grid_is_the_stated_one():
    points = tune_mod.grid(0.003, 4)
    assert sorted(points) == sorted((0.003 * f, e) for f in (1 / 3, 1.0, 3.0) for e in (2, 4, 8))
    assert {e for _, e in tune_mod.grid(0.003, 1)} == {1, 2}  # rounded, at least 1


def test_epsilon_of_the_selection_against_dp_accounting(plan):
    """The whole selection, recomputed with dp-accounting alone from the plan's public numbers
    (the longest point's z, the score's noise, K's distribution), meets the target."""
    ref = max(plan.grid, key=lambda c: c.steps)
    direct = selected_epsilon(
        0.1, ref.steps, ref.noise_multiplier, tune_mod.SCORE_NOISE, 3.0, 0.0, DELTA
    )
    assert plan.epsilon() == pytest.approx(direct, rel=1e-9)
    assert direct <= 4.0
    assert direct > 4.0 - 0.05  # calibrated to the target, not far below it
    one_run = selected_epsilon(0.1, ref.steps, ref.noise_multiplier, tune_mod.SCORE_NOISE,
                               1.0, 1.0, DELTA)  # fmt: skip
    assert one_run < direct - 0.5  # the selection's overhead is paid


def test_every_grid_point_is_bounded_by_the_accounted_one(plan):
    """Each point's RDP curve lies under the longest point's at every order (so the uniform
    draw is bounded by it), and a shorter point is not given more noise than it needs."""
    ref = max(plan.grid, key=lambda c: c.steps)
    bound = _curve(ref.noise_multiplier, 0.1, ref.steps)
    for c in plan.grid:
        assert np.all(_curve(c.noise_multiplier, 0.1, c.steps) <= bound)
        if c.steps < ref.steps:
            assert c.noise_multiplier < ref.noise_multiplier
            assert not np.all(_curve(c.noise_multiplier * 0.99, 0.1, c.steps) <= bound)


# -- K ---------------------------------------------------------------------------------------


def _logarithmic_pmf(k: int, mean: float) -> float:
    p = 1.0 - tnb_gamma(mean, 0.0)
    return -(p**k) / (k * math.log(1.0 - p))


def test_k_follows_the_logarithmic_distribution():
    """Sampled with a fixed seed (as --insecure-reproducible-noise would): mean and the
    first probabilities of the logarithmic distribution with E[K] = 3."""
    rng = np.random.default_rng(12345)
    ks = np.array([draw_runs(tune_mod.DEFAULT_RUNS, rng) for _ in range(20000)])
    assert ks.min() >= 1
    assert ks.mean() == pytest.approx(3.0, abs=0.15)
    for k in (1, 2, 3):
        expected = _logarithmic_pmf(k, 3.0)
        se = math.sqrt(expected * (1 - expected) / len(ks))
        assert abs((ks == k).mean() - expected) < 5 * se


def test_select_best_runs_k_uniform_points_and_keeps_the_best_output():
    grid = ["a", "b", "c"]
    runs = RunCount(3.0, 0.0)
    k = draw_runs(runs, np.random.default_rng(7))
    seen = []

    def run(point, i):
        seen.append(point)
        return {"a": 1.0, "b": 3.0, "c": 2.0}[point], f"model-{i}"

    best = select_best(grid, run, runs, np.random.default_rng(7))
    assert best.runs == k == len(seen)
    assert best.choice == max(seen, key=lambda p: {"a": 1, "b": 3, "c": 2}[p])
    assert best.output == f"model-{seen.index(best.choice)}"


def test_score_is_the_gaussian_mechanism_on_the_count():
    rng = np.random.default_rng(0)
    draws = np.array([tune_mod.noisy_score(10, tune_mod.SCORE_NOISE, rng) for _ in range(4000)])
    assert draws.mean() == pytest.approx(10, abs=0.5)
    assert draws.std() == pytest.approx(tune_mod.SCORE_NOISE, rel=0.05)


# -- the validation split --------------------------------------------------------------------


def _texts(n: int) -> LabeledTexts:
    return LabeledTexts(
        tuple(f"text {i}" for i in range(n)), tuple(i % 2 for i in range(n)), ("a", "b")
    )


def test_validation_split_is_disjoint_and_per_row():
    data = _texts(400)
    fit, val = tune_mod.split_validation(data, seed=0)
    assert len(fit) + len(val) == 400
    assert not set(fit.texts) & set(val.texts)
    assert 40 < len(val) < 120  # about 20%
    # one row more changes each side by that row alone
    more = LabeledTexts((*data.texts, "new row"), (*data.labels, 0), ("a", "b"))
    fit2, val2 = tune_mod.split_validation(more, seed=0)
    assert set(fit2.texts) ^ set(fit.texts) | set(val2.texts) ^ set(val.texts) == {"new row"}
    # independent of the test hold-out's keys (another purpose)
    _, held = data.split(0.2, seed=0)
    assert set(held.texts) != set(val.texts)


# -- the run, with a stand-in for each candidate's training -----------------------------------


@pytest.fixture(scope="module")
def tiny_small(tmp_path_factory):
    from dpfit.models import save_tiny_random_model, write_tiny_sentiment_csv

    root = tmp_path_factory.mktemp("tune")
    return (
        str(save_tiny_random_model(root / "model")),
        str(write_tiny_sentiment_csv(root / "data.csv", n=120)),
    )


@pytest.mark.parametrize("insecure", [True, False])
def test_candidates_train_on_the_fit_part_and_score_on_validation(
    tiny_small, monkeypatch, insecure
):
    """Each candidate trains on rows disjoint from the validation rows, is scored on those,
    runs at its grid point's planned noise; K candidates run (K from OS randomness unless
    --insecure-reproducible-noise); no validation score leaves."""
    import dpfit.train

    model, data = tiny_small
    calls = []
    seeds = []
    real_rng = tune_mod.selection_rng

    def recording_rng(seed):
        seeds.append(seed)
        return real_rng(seed)

    monkeypatch.setattr(tune_mod, "selection_rng", recording_rng)

    def fake_train(config, on_step=None, on_note=None, *, prepared, task, set_by):
        split = prepared.state["data"]
        calls.append((config, split.train, split.test, prepared.model, prepared.tokenizer))
        steps = config.head_epochs * 3 + config.epochs * 3  # what the plan assumed, below
        privacy = {
            "noise_multiplier": config.noise_multiplier,
            "sample_rate": 0.0,
            "steps": steps,
            "history": [],
        }
        per_class = {"neg": {"n": 1, "correct": 123456, "predicted": 0}}
        metrics = {"per_class": per_class, "accuracy": 0.987654, "head_first_accuracy": 0.87654}
        return TrainResult(metrics, [], prepared.model, prepared.tokenizer, privacy)

    scored, predicted = [], []
    real_noisy, real_predict = tune_mod.noisy_score, tune_mod.predict

    def recording_noisy(right, noise, rng):
        scored.append(right)
        return real_noisy(right, noise, rng)

    def recording_predict(model, tokenizer, data, *a, **kw):
        predicted.append(data)
        return real_predict(model, tokenizer, data, *a, **kw)

    monkeypatch.setattr(dpfit.train, "train", fake_train)
    monkeypatch.setattr(tune_mod, "noisy_score", recording_noisy)
    monkeypatch.setattr(tune_mod, "predict", recording_predict)
    cfg = TrainConfig(model=model, data=data, seed=0, insecure_reproducible_noise=insecure)
    result = tune_mod.tune(cfg)
    if insecure:
        assert seeds == [tune_mod.insecure_seed(cfg, 0x7E)] and seeds[0] is not None
        assert len(calls) == draw_runs(tune_mod.DEFAULT_RUNS, real_rng(seeds[0]))
    else:
        assert seeds == [None]  # OS entropy
    from dpfit.tasks.classification import prepare_data

    rows = prepare_data(cfg).train  # the training part (the test rows already held out)
    fit, val = tune_mod.split_validation(rows, cfg.seed)
    pairs = lambda d: Counter(zip(d.texts, d.labels, strict=True))  # noqa: E731
    assert pairs(fit) + pairs(val) == pairs(rows)  # each row on exactly one side
    planned = {
        (c["lr"], c["epochs"]): c["noise_multiplier"] for c in result.metrics["tuning"]["grid"]
    }
    # each candidate trains on the fit part with no evaluation rows of its own; the
    # validation rows are predicted once per candidate, and its score counts them right
    assert len(predicted) == len(scored) == len(calls)
    for (config, train, test, m, tok), seen, right in zip(calls, predicted, scored, strict=True):
        assert train == fit and len(test) == 0 and seen == val
        assert config.noise_multiplier == planned[(config.lr, config.epochs)]
        assert config.output is None and config.checkpoint_dir is None
        preds = real_predict(m, tok, val, config.max_length)
        assert right == sum(int(p == y) for p, y in zip(preds, val.labels, strict=True))
    assert 0 < len(val) < len(fit)
    text = json.dumps(result.metrics) + " ".join(result.notes)
    for secret in ("123456", "0.987654", "0.87654"):
        assert secret not in text
    assert "runs" not in result.metrics  # K is not released
    assert result.metrics["epsilon"] <= 8.0


def test_refuses_what_the_selection_does_not_cover():
    for bad in (
        dict(non_private=True),
        dict(noise_multiplier=1.0),
        dict(neighbouring="replace-one"),
        dict(accountant="pld"),
        dict(checkpoint_dir="x"),
        dict(max_steps=3),
    ):
        with pytest.raises(tune_mod.TuneError):
            tune_mod.check_tunable(dataclasses.replace(TrainConfig(), **bad))


# -- end to end --------------------------------------------------------------------------------


def test_cli_tune_end_to_end(tiny_small, tmp_path):
    from dpfit.cli import main

    model, data = tiny_small
    out = tmp_path / "run"
    rc = main(["train", "--model", model, "--data", data, "--tune", "--output", str(out),
               "--epsilon", "4", "--insecure-reproducible-noise", "--seed", "1"])  # fmt: skip
    assert rc == 0
    m = json.loads((out / "metrics.json").read_text())
    tuning = m["tuning"]
    ref = max(tuning["grid"], key=lambda c: c["steps"])
    direct = selected_epsilon(
        m["sample_rate"],
        ref["steps"], ref["noise_multiplier"], tuning["score_noise"], tuning["mean_runs"],
        tuning["runs_shape"], m["delta"],
    )  # fmt: skip
    assert m["epsilon"] == pytest.approx(direct, rel=1e-9)
    assert m["epsilon"] <= 4.0
    assert (m["lr"], m["epochs"]) in {(c["lr"], c["epochs"]) for c in tuning["grid"]}
    assert m["config"]["tune"] is True
    dp = json.loads((out / "model" / "dpfit.json").read_text())
    assert dp["epsilon"] == m["epsilon"] and dp["epsilon_replace_one"] is None
    assert "nan" in (out / "steps.csv").read_text().splitlines()[1]
    assert 0.0 <= m["accuracy"] <= 1.0


def test_cli_tune_refuses_non_private(tiny_small, capsys):
    from dpfit.cli import main

    model, data = tiny_small
    assert main(["train", "--model", model, "--data", data, "--tune", "--non-private"]) != 0
    assert "--tune does not support --non-private" in capsys.readouterr().err


def test_too_few_validation_units_get_a_warning_that_the_choice_is_near_random():
    assert tune_mod.blur_note(tune_mod.SCORE_NOISE, 300, "row") is None  # 1.7 points
    note = tune_mod.blur_note(tune_mod.SCORE_NOISE, 24, "user")
    assert "21% of accuracy on 24 validation users" in note and "close to random" in note

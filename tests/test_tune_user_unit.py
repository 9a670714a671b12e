"""dpfit train --tune --privacy-unit user: the selection protects a user, not a row.

The validation split keeps each user whole and depends on that user alone, the score moves by
at most 1 when one user (with all their rows) is added or removed, every candidate trains at
the user level on the fit users only and is scored by that score, and the released run's
epsilon (checked against dp-accounting directly) counts users; no count of rows is written.
"""

from __future__ import annotations

import csv
import json
import random
from collections import Counter

import pytest
from accounting_oracle import selected_epsilon
from written_numbers import written_numbers

from dpfit.data.text import LabeledTexts
from dpfit.models import TINY_WORDS, save_tiny_random_model
from dpfit.run import tune as tune_mod
from dpfit.run.config import TrainConfig, TrainResult

pytest.importorskip("transformers")


def _rows(users: list[str]) -> LabeledTexts:
    texts = tuple(f"row {i} of {u}" for i, u in enumerate(users))
    return LabeledTexts(texts, tuple(i % 2 for i in range(len(users))), ("a", "b"))


def test_validation_split_keeps_each_user_whole_and_depends_on_that_user_alone():
    users = [f"u{i % 80}" for i in range(400)]
    fit, val = tune_mod.split_validation_users(_rows(users), users, seed=0)
    assert not set(fit.users) & set(val.users)
    assert len(fit.rows) + len(val.rows) == 400
    assert 5 < len(val) < 30  # about 20% of 80 users
    # one user more (three rows) changes one side by that user's rows alone
    more = [*users, "new", "new", "new"]
    fit2, val2 = tune_mod.split_validation_users(_rows(more), more, seed=0)
    assert set(fit2.users) ^ set(fit.users) | set(val2.users) ^ set(val.users) == {"new"}
    # independent of the test hold-out's keys (another purpose)
    from dpfit.data.text import UserTexts

    _, held = UserTexts(_rows(users), tuple(users)).split(0.2, seed=0)
    assert set(held.users) != set(val.users)


def test_user_score_moves_by_at_most_one_when_a_user_is_added_or_removed():
    rng = random.Random(0)
    users = [f"u{rng.randrange(30)}" for _ in range(300)]  # 1 to ~20 rows a user
    labels = [rng.randrange(3) for _ in users]
    preds = [y if rng.random() < 0.7 else (y + 1) % 3 for y in labels]
    whole = tune_mod.user_score(preds, labels, users)
    for gone in set(users):
        keep = [i for i, u in enumerate(users) if u != gone]
        part = tune_mod.user_score(
            [preds[i] for i in keep], [labels[i] for i in keep], [users[i] for i in keep]
        )
        assert 0.0 <= whole - part <= 1.0 + 1e-12
    # by hand: u0 2 of 3 right, u1 1 of 1, u2 0 of 2
    assert tune_mod.user_score(
        [1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 1], ["u0", "u0", "u0", "u1", "u2", "u2"]
    ) == pytest.approx(2 / 3 + 1)
    # a user with many rows counts at most 1, where the row count would move by all of them
    many = ["big"] * 20 + ["small"]
    assert tune_mod.user_score([1] * 21, [1] * 21, many) == pytest.approx(2.0)


# -- the run ---------------------------------------------------------------------------------


def _user_csv(path, users: int, seed: int = 0, rows=(2, 6)) -> str:
    rng = random.Random(seed)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label", "user_id"])
        for u in range(users):
            for r in range(rng.randint(*rows)):
                y = rng.random() < 0.5
                text = f"the film was {'good' if y else 'bad'} {rng.choice(TINY_WORDS)} r{u}x{r}"
                w.writerow([text, "pos" if y else "neg", f"u{u}"])
    return str(path)


@pytest.fixture(scope="module")
def tiny_users(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune_users")
    return str(save_tiny_random_model(root / "model")), _user_csv(root / "users.csv", 80)


def _config(model: str, data: str, **kw) -> TrainConfig:
    return TrainConfig(
        model=model, data=data, privacy_unit="user", user_column="user_id",
        public_labels=True, max_length=16, insecure_reproducible_noise=True, **kw,
    )  # fmt: skip


def test_candidates_train_on_fit_users_and_are_scored_per_user(tiny_users, monkeypatch):
    """Each candidate's training items are the fit part's users (n counts them, no validation
    user among them), and its score is the per-user score of its predictions on the
    validation users' rows."""
    import dpfit.train
    from dpfit.tasks.classification import ClassificationTask, predict

    model, data = tiny_users
    calls, scored = [], []

    def fake_train(config, on_step=None, on_note=None, *, prepared, task, set_by):
        calls.append((config, prepared))
        privacy = {
            "noise_multiplier": config.noise_multiplier, "sample_rate": 0.0, "steps": 0,
            "history": [],
        }  # fmt: skip
        metrics = {"per_class": {"neg": {"n": 1, "correct": 123456, "predicted": 0}}}
        return TrainResult(metrics, [], prepared.model, prepared.tokenizer, privacy)

    real_noisy = tune_mod.noisy_score

    def recording_noisy(right, noise, rng):
        scored.append(right)
        return real_noisy(right, noise, rng)

    monkeypatch.setattr(dpfit.train, "train", fake_train)
    monkeypatch.setattr(tune_mod, "noisy_score", recording_noisy)
    cfg = _config(model, data, seed=0)
    result = tune_mod.tune(cfg)

    prep = ClassificationTask().prepare(cfg)
    rows, users = prep.state["data"].train, prep.state["data"].users
    fit, val = tune_mod.split_validation_users(rows, users, cfg.seed)
    assert calls and len(scored) == len(calls)
    pairs = lambda d: Counter(zip(d.texts, d.labels, strict=True))  # noqa: E731
    assert pairs(fit.rows) + pairs(val.rows) == pairs(rows)
    for (config, p), right in zip(calls, scored, strict=True):
        split = p.state["data"]
        assert split.train == fit.rows and len(split.test) == 0  # scored once, by tune
        assert p.privacy_unit == "user" and p.n == len(fit) < len(fit.rows)
        grouped = {split.users[i] for g in p.state["groups"] for i in g}
        assert grouped == set(fit.users) and not grouped & set(val.users)
        preds = predict(p.model, p.tokenizer, val.rows, config.max_length)
        assert right == pytest.approx(tune_mod.user_score(preds, val.rows.labels, val.users))
        assert right != 123456  # not the row count of the candidate's metrics
    m = result.metrics
    assert m["privacy_unit"] == "user" and m["train_examples"] == len(fit) == m["users"]
    assert m["tuning"]["validation_split"].startswith("by user")
    assert "fraction of their rows" in m["tuning"]["score"]
    assert any(f"{len(val)} of {len(fit) + len(val)} training users" in n for n in result.notes)
    # 16 or so validation users: the score's noise hides any difference, and the note says so
    assert any("close to random" in n and f"on {len(val)} validation users" in n
               for n in result.notes)  # fmt: skip


def test_cli_tune_user_unit_end_to_end(tiny_users, tmp_path):
    from dpfit.cli import main

    model, data = tiny_users
    out = tmp_path / "run"
    rc = main(["train", "--model", model, "--data", data, "--tune", "--output", str(out),
               "--epsilon", "4", "--insecure-reproducible-noise", "--seed", "1",
               "--privacy-unit", "user", "--user-column", "user_id", "--public-labels",
               "--max-length", "16", "--threads", "1", "--quiet"])  # fmt: skip
    assert rc == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["privacy_unit"] == "user" and m["users"] == m["train_examples"]
    users = m["users"]
    tuning = m["tuning"]
    ref = max(tuning["grid"], key=lambda c: c["steps"])
    # q and n count the fit part's users; the whole selection against dp-accounting
    assert m["sample_rate"] == pytest.approx(m["batch_size"] / users)
    direct = selected_epsilon(
        m["batch_size"] / users, ref["steps"], ref["noise_multiplier"], tuning["score_noise"],
        tuning["mean_runs"], tuning["runs_shape"], m["delta"],
    )  # fmt: skip
    assert m["epsilon"] == pytest.approx(direct, rel=1e-9) and m["epsilon"] <= 4.0
    record = json.loads((out / "model" / "dpfit.json").read_text())
    assert record["privacy_unit"] == "user" and record["epsilon"] == m["epsilon"]
    # no count of the users' rows is written (the fit part's, the validation part's)
    from dpfit.tasks.classification import ClassificationTask

    cfg = _config(model, data, seed=1)
    prep = ClassificationTask().prepare(cfg)
    fit, val = tune_mod.split_validation_users(
        prep.state["data"].train, prep.state["data"].users, cfg.seed
    )
    assert len(fit) == users and len(fit.rows) > users
    written = written_numbers(m)
    assert len(fit.rows) not in written and len(val.rows) not in written

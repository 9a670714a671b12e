"""--privacy-unit user: one person's rows sampled and clipped as one contribution.

Checked against the microbatch-of-one oracle (each row alone, float64, a user's gradient the
sum of their rows', clipped once), a noise draw per logical step (not per physical batch),
epsilon from dp-accounting directly with n = users, splits by user (all of a user's rows on
one side, each user's side from their id alone), the per-user row cap, the label gate counting
users, the run end to end from the CLI (classification) and on .jsonl rows (causal LM), and
the refusals of what cannot run."""

from __future__ import annotations

import csv
import json
import math
import random

import pytest
import torch
from accounting_oracle import ADD_REMOVE, direct_epsilon
from noise_check import assert_std
from oracle import Capture, assert_close_to_oracle
from written_numbers import written_numbers

import dpfit
from dpfit.cli import main
from dpfit.data.text import (
    MAX_ROWS_PER_USER,
    ColumnError,
    LabeledTexts,
    UserTexts,
    load_grouped_texts,
)
from dpfit.errors import DPFitError
from dpfit.models import TINY_WORDS, load_classifier, save_tiny_random_model
from dpfit.tasks import Prepared
from dpfit.tasks.classification import ClassificationTask, PreparedData, recorded_held_out
from dpfit.tasks.labels import RareLabelError
from dpfit.train import TrainConfig, train

pytest.importorskip("transformers")

LENGTH = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_random_model(tmp_path_factory.mktemp("users") / "bert")


def _user_csv(path, users: int, seed: int = 0, rows=(1, 6), column: str = "user_id") -> str:
    """Each user 1 to 6 short reviews (the label in a word), users u0, u1, ..."""
    rng = random.Random(seed)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label", column])
        for u in range(users):
            for r in range(rng.randint(*rows)):
                y = rng.random() < 0.5
                word = rng.choice(TINY_WORDS)
                text = f"the film was {'good' if y else 'bad'} {word} r{u}x{r}"  # unique
                w.writerow([text, "pos" if y else "neg", f"u{u}"])
    return str(path)


def _users_of(path) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [r["user_id"] for r in csv.DictReader(f)]


# -- splits and the cap ----------------------------------------------------------------------


def _data(users: list[str], texts: list[str] | None = None) -> UserTexts:
    texts = texts or [f"row {i} of {u}" for i, u in enumerate(users)]
    rows = LabeledTexts(tuple(texts), tuple(len(t) % 2 for t in texts), ("a", "b"))
    return UserTexts(rows, tuple(users))


def test_hold_out_keeps_each_user_whole_and_depends_on_that_user_alone():
    users = [f"u{i % 50}" for i in range(300)]
    data = _data(users)
    rest, held = data.split(0.2, seed=3)
    assert len(rest) + len(held) == 50 and len(held) > 0
    assert not set(rest.users) & set(held.users)  # no user on both sides
    assert len(rest.users) + len(held.users) == 300  # every row of a user went with them
    # another user added, or rows added to one user: nobody else changes side
    more = _data([*users, "new", "u7", "u7"], [*data.rows.texts, "x", "y", "z"])
    rest2, held2 = more.split(0.2, seed=3)
    assert set(held2.users) - {"new"} == set(held.users)


def test_each_user_keeps_at_most_k_rows_chosen_by_their_own_rows():
    users = ["a"] * 10 + ["b"] * 2 + ["c"] * 40
    data = _data(users)
    capped = data.capped(3, seed=1)
    counts = {u: capped.users.count(u) for u in "abc"}
    assert counts == {"a": 3, "b": 2, "c": 3}
    kept_a = {t for t, u in zip(capped.rows.texts, capped.users, strict=True) if u == "a"}
    # shuffled file, other users changed: user a keeps the same rows
    order = list(range(len(users)))
    random.Random(0).shuffle(order)
    other = _data(
        [users[i] for i in order if users[i] != "c"] + ["d"] * 5,
        [data.rows.texts[i] for i in order if users[i] != "c"] + [f"d{i}" for i in range(5)],
    ).capped(3, seed=1)
    assert {t for t, u in zip(other.rows.texts, other.users, strict=True) if u == "a"} == kept_a
    default = data.capped(MAX_ROWS_PER_USER).users
    assert {u: default.count(u) for u in "abc"} == {"a": 10, "b": 2, "c": MAX_ROWS_PER_USER}


def test_the_label_gate_counts_users_not_rows(tmp_path, folder):
    """25 rows of a name from one user are one unit: refused without --labels."""
    path = tmp_path / "rare.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label", "user_id"])
        for u in range(40):
            w.writerow([f"the film was good {u}", "common", f"u{u}"])
        for i in range(25):
            w.writerow([f"the film was bad {i}", "alice", "u0"])
    cfg = TrainConfig(model=str(folder), data=str(path), privacy_unit="user",
                      user_column="user_id", eval_data=str(path))  # fmt: skip
    with pytest.raises(RareLabelError, match="fewer than 20 users"):
        ClassificationTask().prepare(cfg)


def test_empty_and_missing_user_ids_are_refused(tmp_path):
    path = tmp_path / "blank.csv"
    path.write_text("text,label,user_id\ngood film,pos,u1\nbad film,neg,\n", encoding="utf-8")
    with pytest.raises(ColumnError, match=r"1 row\(s\) have an empty 'user_id' \(line 3\)"):
        load_grouped_texts(path, "user_id", flag="--user-column", required=True)
    with pytest.raises(ColumnError, match="no column 'person'.*--user-column"):
        load_grouped_texts(path, "person", flag="--user-column", required=True)


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"privacy_unit": "user"}, "needs --user-column COL"),
        ({"user_column": "user_id"}, "add --privacy-unit user"),
        ({"max_rows_per_user": 4}, "add --privacy-unit user"),
        ({"privacy_unit": "user", "user_column": "u", "data": None}, "bundled data has no users"),
        ({"privacy_unit": "user", "user_column": "u", "non_private": True}, "--non-private"),
        ({"privacy_unit": "user", "user_column": "u", "head_first": True}, "--head-first"),
        ({"privacy_unit": "user", "user_column": "u", "mode": "full"}, "--mode bias"),
        ({"privacy_unit": "user", "user_column": "u", "full_epochs": 1, "epochs": 2},
         "--mode bias"),
        ({"privacy_unit": "user", "user_column": "u", "task": "image-classification"},
         "causal-lm or classification"),
    ],
)  # fmt: skip
def test_bad_combinations_are_refused_before_reading_data(changes, match):
    with pytest.raises(DPFitError, match=match):
        train(TrainConfig(**{"data": "/nonexistent.csv", **changes}))


# -- the oracle: a user's rows across physical batches, summed, clipped once -------------------

ROWS = (3, 1, 2)  # users of 3, 1 and 2 rows: in physical batches of 2 the first spans two


def _tiny_classifier(folder):
    """float64, no dropout, random head and biases (a zero head passes no gradient on)."""
    loaded = load_classifier(folder, ["neg", "pos"], seed=0)
    model = loaded.model.double().eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or any(name.startswith(h) for h in loaded.head_names):
                p.normal_(0, 0.3)
    dpfit.make_bias_trainable(model, train_head=loaded.head_names)
    return model, loaded.tokenizer


def _user_rows() -> tuple[LabeledTexts, tuple[str, ...]]:
    rng = random.Random(5)
    texts, labels, users = [], [], []
    for u, k in enumerate(ROWS):
        for r in range(k):
            texts.append(" ".join(rng.choices(TINY_WORDS, k=3 + 2 * r + u)))
            labels.append((u + r) % 2)
            users.append(f"user{u}")
    return LabeledTexts(tuple(texts), tuple(labels), ("neg", "pos")), tuple(users)


def _oracle_users(folder) -> torch.Tensor:
    """(users, trainable elements): each row run alone, its gradient summed per user."""
    model, tok = _tiny_classifier(folder)
    rows, users = _user_rows()
    params = [p for p in model.parameters() if p.requires_grad]
    out: dict[str, torch.Tensor] = {}
    for text, y, u in zip(rows.texts, rows.labels, users, strict=True):
        enc = tok(text, truncation=True, max_length=LENGTH, return_tensors="pt")
        loss = model(**enc, labels=torch.tensor([y])).loss
        g = torch.cat([x.flatten() for x in torch.autograd.grad(loss, params)])
        out[u] = out.get(u, 0) + g
    return torch.stack([out[u] for u in sorted(out)])


def _released(folder, max_grad_norm: float, physical: int = 2) -> torch.Tensor:
    """One logical step (q = 1, noise 0) of the engine over the task's user items."""
    model, tok = _tiny_classifier(folder)
    rows, users = _user_rows()
    task = ClassificationTask()
    cfg = TrainConfig(max_length=LENGTH, privacy_unit="user", user_column="user_id")
    split = PreparedData(train=rows, test=rows, notes=(), users=users)
    prep = Prepared(model, tok, len(rows), 2, (), state={"data": split, "pooling": "cls"})
    task._group_users(prep, cfg, users)  # as ClassificationTask.prepare does
    assert prep.n == len(ROWS) and prep.privacy_unit == "user"
    items = task.items(prep, LENGTH)
    assert sorted(len(rs) for rs in items) == sorted(ROWS)
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=prep.n, sample_size=prep.n, noise_multiplier=0.0,
        max_grad_norm=max_grad_norm, clipping="flat", privacy_unit="document",
    )  # fmt: skip
    opt = Capture(engine.parameters())
    loader = engine.data_loader(
        items, task.collate(prep, False), physical_batch_size=physical, optimizer=opt
    )
    batches = 0
    for batch in loader:
        task.loss(model, batch).backward()
        batches += 1
        if engine.step(opt):
            break
    assert batches == math.ceil(sum(ROWS) / physical)  # of 2: the 3-row user spans two
    engine.detach()
    return torch.cat([opt.grads[p].flatten() for p in engine.parameters()])


@pytest.fixture(scope="module")
def oracle(folder):
    return _oracle_users(folder)


def test_unclipped_user_gradient_is_the_sum_of_their_rows(folder, oracle):
    assert_close_to_oracle(_released(folder, max_grad_norm=1e6), oracle.sum(0) / len(ROWS))


def test_each_user_is_clipped_as_one_contribution(folder, oracle):
    """R below every user's norm: each user contributes exactly R / B in the direction of
    their rows' summed gradient, however many rows or physical batches they span; clipping
    each row alone would release something else."""
    r = 0.25 * float(oracle.norm(dim=1).min())
    got = _released(folder, max_grad_norm=r)
    factors = (r / oracle.norm(dim=1)).clamp(max=1.0)
    assert_close_to_oracle(got, (factors[:, None] * oracle).sum(0) / len(ROWS))
    rows_alone = _released(folder, max_grad_norm=r, physical=1)  # same, one row a batch
    assert_close_to_oracle(rows_alone, (factors[:, None] * oracle).sum(0) / len(ROWS))


# -- noise: one draw per logical step, whatever the physical batches -------------------------


def test_noise_is_drawn_once_per_logical_step():
    """Users of 1 to 4 rows, physical batches of 1 row (a step spans several), zero
    gradients: each released step is N(0, (sigma R / B)^2), not one draw per batch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    sigma, r, b = 1.3, 0.5, 4
    rows = torch.randn(20, 3)
    users = [[rows[i] for i in range(s, s + 1 + s % 4)] for s in range(0, 16, 4)]  # 4 users
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=b, sample_size=len(users), noise_multiplier=sigma,
        max_grad_norm=r, privacy_unit="document",
    )  # fmt: skip
    opt = torch.optim.SGD(engine.parameters(), lr=0.0)
    draws, batches = [], 0
    opt.register_step_pre_hook(
        lambda o, a, k: draws.append(torch.cat([p.grad.flatten() for p in engine.parameters()]))
    )
    loader = engine.data_loader(users, torch.stack, physical_batch_size=1, optimizer=opt)
    for _ in range(300):  # q = 1: one logical step a pass, every user drawn
        for x in loader:
            (model(x) * 0).sum().backward()
            engine.step(opt)
            batches += 1
    assert engine.steps_taken == 300 and batches == 300 * sum(len(u) for u in users)
    assert_std(torch.stack(draws), sigma * r / b)


# -- the run end to end ----------------------------------------------------------------------


def _args(folder, data, out, *extra) -> list[str]:
    return [
        "train", "--model", str(folder), "--data", data, "--max-length", str(LENGTH),
        "--batch-size", "8", "--physical-batch-size", "4", "--epochs", "1", "--epsilon", "4",
        "--threads", "1", "--quiet", "--output", str(out), "--public-labels",
        "--privacy-unit", "user", "--user-column", "user_id", *extra,
    ]  # fmt: skip


def test_cli_user_unit_end_to_end(folder, tmp_path, capsys):
    data = _user_csv(tmp_path / "users.csv", 60, rows=(2, 6))
    out = tmp_path / "run"
    assert main(_args(folder, data, out, "--max-rows-per-user", "3")) == 0
    table = capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())
    rows = _users_of(data)
    train_users = m["users"]
    assert 40 <= train_users < 60 and len(rows) > 2 * 60  # a tenth of the users held out
    # n, q and the recipe count users; epsilon against dp-accounting with n = users
    assert m["privacy_unit"] == "user" and m["train_examples"] == train_users
    assert m["sample_rate"] == pytest.approx(8 / train_users)
    assert m["steps"] == round(train_users / 8)
    want = direct_epsilon(m["noise_multiplier"], 8 / train_users, m["steps"], m["delta"],
                          ADD_REMOVE, kind="rdp")  # fmt: skip
    assert m["epsilon"] == pytest.approx(want, rel=1e-6) and m["epsilon"] <= 4.0 * 1.001
    assert m["delta"] == pytest.approx(min(1e-5, train_users**-1.1))
    record = json.loads((out / "model" / "dpfit.json").read_text())
    assert record["privacy_unit"] == "user" and record["users"] == train_users
    assert record["sample_size"] == train_users
    assert "user (all their rows" in table and "training users" in table
    # the number of training rows follows the users' private row counts: written nowhere
    task = ClassificationTask()
    prep = task.prepare(
        TrainConfig(model=str(folder), data=data, max_length=LENGTH, privacy_unit="user",
                    user_column="user_id", max_rows_per_user=3, public_labels=True)
    )  # fmt: skip
    n_rows = len(prep.state["data"].train)
    assert n_rows > train_users and prep.n == train_users
    assert f" {n_rows} " not in table and n_rows not in written_numbers(m)
    # the held-out users, re-derived for dpfit evaluate --held-out: whole users, none trained
    held = recorded_held_out(out / "model", data, ("neg", "pos"))
    assert len(held) == m["eval_n"]
    train_set = set(prep.state["data"].users)
    held_users = {u for t, u in zip(*_csv_columns(data), strict=True) if t in set(held.texts)}
    assert held_users and not held_users & train_set
    assert sum(u in held_users for u in rows) == len(held)  # every row of a held-out user


def _csv_columns(path):
    with open(path, encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [r["text"] for r in rows], [r["user_id"] for r in rows]


def test_cli_user_unit_with_windows(folder, tmp_path):
    """--stride too: each row cut into windows, all of a user's windows one contribution."""
    data = _user_csv(tmp_path / "users.csv", 30, rows=(1, 3))
    out = tmp_path / "run"
    assert main(_args(folder, data, out, "--stride", "12")) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["privacy_unit"] == "user" and m["window_length"] == LENGTH and m["stride"] == 12
    assert m["train_examples"] == m["users"] and "train_documents" not in m
    assert m["head_first_steps"] == 0  # no probe on single rows under the user unit


# -- causal LM on .jsonl rows ----------------------------------------------------------------


def test_causal_lm_user_unit_on_jsonl_rows(tmp_path):
    from test_causal_lm import CharTokenizer, tiny_llama

    from dpfit.tasks.causal_lm import CausalLMTask

    class Tiny(CausalLMTask):
        def _load_model(self, config):
            return tiny_llama(), CharTokenizer()

    path = tmp_path / "notes.jsonl"
    lines = [
        {"text": f"note {i} of {u}: " + "we the people " * (1 + i % 4), "who": u}
        for i, u in enumerate(f"p{j % 30}" for j in range(120))
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n", encoding="utf-8")
    task = Tiny(eval_examples=8, sample_prompts=("we",), sample_tokens=2)
    cfg = TrainConfig(
        task="causal-lm", data=str(path), max_length=32, stride=24, privacy_unit="user",
        user_column="who", max_rows_per_user=2, batch_size=4, physical_batch_size=3, epochs=1,
        epsilon=4.0,
    )  # fmt: skip
    prep = task.prepare(cfg)
    users = prep.n
    assert 20 <= users < 30 and prep.privacy_unit == "user"
    assert len(prep.state["docs"]) == sum(len(g) for g in prep.state["groups"]) <= 2 * users
    res = train(cfg, prepared=prep, task=task)
    m = res.metrics
    assert m["privacy_unit"] == "user" and m["users"] == users == m["train_examples"]
    assert m["sample_rate"] == pytest.approx(4 / users) and "train_documents" not in m
    assert res.privacy["privacy_unit"] == "user" and math.isfinite(m["perplexity_after"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a note", "who": "p1"}\n{"text": "another", "who": " "}\n')
    with pytest.raises(DPFitError, match="line 2: no user in 'who'"):
        task.prepare(TrainConfig(**{**cfg.__dict__, "data": str(bad)}))

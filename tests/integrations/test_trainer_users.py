"""DPTrainer with PrivacyArguments(privacy_unit="user", user_column=...): a dataset of rows
grouped by DPTrainer into one document per user (at most max_rows_per_user rows each, chosen
by a keyed row hash), users sampled, a user's rows summed and clipped once (also across
physical batches); n counts users. Checked against the microbatch-of-one oracle (float64) and
dp-accounting."""

import json

import pytest
import torch
import torch.nn.functional as F
from accounting_oracle import ADD_REMOVE, direct_epsilon
from trainer_args import sgd_training_args, trainable

pytest.importorskip("transformers")

from transformers import DataCollatorWithPadding  # noqa: E402

from dpfit.errors import DPFitError  # noqa: E402
from dpfit.integrations import DPTrainer, PrivacyArguments  # noqa: E402
from dpfit.models import head_module_names, load_classifier, save_tiny_random_model  # noqa: E402
from dpfit.params import make_bias_trainable  # noqa: E402

WORDS = ("good", "bad", "great", "awful", "fine", "poor")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return save_tiny_random_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture
def make(tiny_folder):
    """make(rows_per_user, dtype) -> (model, rows, collator): a fresh, identically initialised
    classifier (dropout off, random head) and a flat list of tokenized rows, each with its
    "user_id"; the users' rows are interleaved in the list (not grouped by the caller)."""

    def build(rows_per_user, dtype=torch.float32):
        loaded = load_classifier(tiny_folder, ["neg", "pos"], seed=0)
        for m in loaded.model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.0
        head = loaded.model.head.weight
        with torch.no_grad():
            head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)))
        rows = []
        for r in range(max(rows_per_user)):
            for u, k in enumerate(rows_per_user):
                if r < k:
                    text = f"the film was {WORDS[(u + 2 * r) % 6]} " * (1 + (u + r) % 3)
                    enc = loaded.tokenizer(text)
                    rows.append({**enc, "label": int(u % 3 != 2), "user_id": f"user{u}"})
        return loaded.model.to(dtype), rows, DataCollatorWithPadding(loaded.tokenizer)

    return build


def user_privacy(**kw):
    return PrivacyArguments(privacy_unit="user", user_column="user_id", **kw)


def targs(tmp_path, **kw):
    return sgd_training_args(
        tmp_path, **{**dict(per_device_train_batch_size=4, max_steps=1, learning_rate=1.0), **kw}
    )


def run(make, tmp_path, rows_per_user, privacy, dtype=torch.float32, **kw):
    model, rows, collator = make(rows_per_user, dtype)
    trainer = DPTrainer(model=model, args=targs(tmp_path, **kw), train_dataset=rows,
                        data_collator=collator, privacy=privacy)  # fmt: skip
    start = trainable(model).clone()
    trainer.train()
    return trainer, trainable(model) - start


def user_gradients(make, rows_per_user) -> torch.Tensor:
    """float64: (users, trainables), each row's loss backpropagated alone, summed per user."""
    model, rows, collator = make(rows_per_user, torch.float64)
    make_bias_trainable(model, train_head=head_module_names(model))
    params = [p for p in model.parameters() if p.requires_grad]
    out = torch.zeros(len(rows_per_user), sum(p.numel() for p in params), dtype=torch.float64)
    for row in rows:
        u = int(row["user_id"][4:])
        batch = collator([{k: v for k, v in row.items() if k != "user_id"}])
        out_ = model(**{k: v for k, v in batch.items() if k != "labels"})
        loss = F.cross_entropy(out_["logits"], batch["labels"], reduction="sum")
        out[u] += torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params)])
    return out


def test_each_user_is_clipped_once_as_the_oracle_says(make, tmp_path, recorded_norms):
    """float64, q = 1, sigma = 0, R below every user's norm: the norms clipped are the
    users' (their rows' gradients, each row alone, summed), and the update is their clipped
    mean, to 1e-5 relative. Users of 2, 3, 1 and 2 rows in physical batches of 3: one user's
    rows straddle two batches."""
    rows_per_user = (2, 3, 1, 2)
    grads = user_gradients(make, rows_per_user)
    norms = grads.norm(dim=1)
    r = 0.25 * float(norms.min())
    privacy = user_privacy(noise_multiplier=0.0, max_grad_norm=r, physical_batch_size=3,
                           clipping="test-recording", insecure_seed=0)  # fmt: skip
    trainer, update = run(make, tmp_path, rows_per_user, privacy, dtype=torch.float64,
                          per_device_train_batch_size=len(rows_per_user))  # fmt: skip
    assert len(trainer.train_dataset) == 4  # grouped: one item per user
    (clipped,) = recorded_norms  # one clip, at the end of the logical batch
    err = (clipped.double().sort().values - norms.sort().values).abs().max() / norms.max()
    assert err <= 1e-5
    want = ((r / norms).clamp(max=1.0)[:, None] * grads).sum(0) / len(rows_per_user)
    err = (-update - want).abs().max() / want.abs().max()  # SGD at lr 1
    assert err <= 1e-5, f"relative error {err:.2e}"


def test_epsilon_counts_users_and_rows_are_capped(make, tmp_path):
    """12 users of 1-6 rows, at most 2 rows each, expected 3 users a step, 4 steps: epsilon
    is dp-accounting's for q = 3/12 (users); dpfit.json says user and the users count."""
    rows_per_user = (1, 6, 2, 3, 1, 2, 5, 1, 3, 2, 1, 2)
    sigma, delta, steps, expected = 1.0, 1e-4, 4, 3
    privacy = user_privacy(noise_multiplier=sigma, target_delta=delta, insecure_seed=2,
                           physical_batch_size=2, max_rows_per_user=2)  # fmt: skip
    trainer, _ = run(make, tmp_path, rows_per_user, privacy, max_steps=steps,
                     per_device_train_batch_size=expected)  # fmt: skip
    assert sorted(map(len, trainer.train_dataset)) == sorted(min(k, 2) for k in rows_per_user)
    assert all("user_id" not in row for u in trainer.train_dataset for row in u)
    engine = trainer.privacy_engine
    want = direct_epsilon(sigma, expected / len(rows_per_user), steps, delta, ADD_REMOVE, "rdp")
    assert engine.epsilon() == pytest.approx(want, rel=1e-9)
    trainer.save_model(str(tmp_path / "saved"))
    record = json.loads((tmp_path / "saved" / "dpfit.json").read_text())
    assert record["privacy_unit"] == "user" and record["users"] == len(rows_per_user)
    assert record["sample_size"] == len(rows_per_user)


def test_a_datasets_dataset_of_rows_is_grouped_by_user(make, tmp_path):
    datasets = pytest.importorskip("datasets")
    model, rows, collator = make((2, 1, 3))
    ds = datasets.Dataset.from_list(rows)
    privacy = user_privacy(noise_multiplier=1.0, insecure_seed=0)
    trainer = DPTrainer(model=model, args=targs(tmp_path), train_dataset=ds,
                        data_collator=collator, privacy=privacy)  # fmt: skip
    assert sorted(len(u) for u in trainer.train_dataset) == [1, 2, 3]
    assert trainer.privacy_engine.config.sample_size == 3
    trainer.train()
    assert trainer.privacy_engine.steps_taken == 1


def test_bad_user_settings_are_refused(make, tmp_path):
    with pytest.raises(DPFitError, match="user_column"):
        PrivacyArguments(privacy_unit="user")
    with pytest.raises(DPFitError, match="user_column"):
        PrivacyArguments(user_column="user_id")
    with pytest.raises(DPFitError, match="max_rows_per_user"):
        PrivacyArguments(privacy_unit="user", user_column="u", max_rows_per_user=0)
    model, rows, collator = make((2, 1))
    rows[1]["user_id"] = " "
    with pytest.raises(DPFitError, match=r"rows \[1\] have no user in 'user_id'"):
        DPTrainer(model=model, args=targs(tmp_path), train_dataset=rows, data_collator=collator,
                  privacy=user_privacy())  # fmt: skip
    model, rows, collator = make((2, 1))
    with pytest.raises(DPFitError, match="'person' is not a column"):
        DPTrainer(model=model, args=targs(tmp_path), train_dataset=rows, data_collator=collator,
                  privacy=PrivacyArguments(privacy_unit="user", user_column="person"))  # fmt: skip

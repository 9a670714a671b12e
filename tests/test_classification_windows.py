"""Long texts for --task classification: windows at a stride, each with its text's label; the
document unit against the microbatch-of-one oracle (each window alone, float64, a document's
gradient the sum of its windows', clipped once); predictions from the mean of a text's
windows' logits; the run end to end from the CLI; refusals of what cannot run."""

from __future__ import annotations

import csv
import json
import random

import pytest
import torch
from oracle import Capture, assert_close_to_oracle

import dpfit
from dpfit.cli import main, summary_rows
from dpfit.data.text import LabeledTexts
from dpfit.errors import DPFitError
from dpfit.models import TINY_WORDS, load_classifier, save_tiny_random_model
from dpfit.tasks import Prepared
from dpfit.tasks.classification import (
    ClassificationTask,
    PreparedData,
    encode,
    encode_windows,
    evaluate,
    mean_window_logits,
)
from dpfit.train import TrainConfig, train

pytest.importorskip("transformers")

LENGTH, STRIDE = 16, 12  # [CLS] + 14 text tokens + [SEP]; consecutive windows share 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_random_model(tmp_path_factory.mktemp("clswin") / "bert")


def _words(k: int, seed: int) -> str:
    return " ".join(random.Random(seed).choices(TINY_WORDS, k=k))


def _texts(lengths, labels=None) -> LabeledTexts:
    labels = labels or [i % 2 for i in range(len(lengths))]
    return LabeledTexts(
        tuple(_words(k, 100 + i) for i, k in enumerate(lengths)), tuple(labels), ("neg", "pos")
    )


# -- cutting ---------------------------------------------------------------------------------


@pytest.mark.parametrize("length,stride", [(16, 16), (16, 12), (16, 3), (10, 7)])
def test_windows_cover_every_token_and_carry_the_label(folder, length, stride):
    tok = load_classifier(folder, ["neg", "pos"]).tokenizer
    data = _texts([0, 5, 14, 15, 40, 57], labels=[1, 0, 1, 0, 1, 0])
    docs = encode_windows(data, tok, length, stride)
    assert len(docs) == len(data)
    cls, sep = tok.cls_token_id, tok.sep_token_id
    body, step = length - 2, stride - 2
    for text, y, ws in zip(data.texts, data.labels, docs, strict=True):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert all(w["labels"] == y for w in ws)  # the text's label on every window
        assert all(len(w["input_ids"]) <= length for w in ws)
        assert all(w["input_ids"][0] == cls and w["input_ids"][-1] == sep for w in ws)
        assert all(w["attention_mask"] == [1] * len(w["input_ids"]) for w in ws)
        inner = [w["input_ids"][1:-1] for w in ws]
        # window j holds the text's tokens from j * step, and the last one reaches the end
        for j, part in enumerate(inner):
            assert part == ids[j * step : j * step + body]
        assert len(ws) == 1 or (len(ws) - 2) * step + body < len(ids)  # no window too many
        covered = {j * step + i for j, part in enumerate(inner) for i in range(len(part))}
        assert covered == set(range(len(ids)))


def test_short_texts_are_one_window_encoded_as_without_windows(folder):
    tok = load_classifier(folder, ["neg", "pos"]).tokenizer
    data = _texts([0, 3, 14])  # at most max length - 2 words: one window each
    docs = encode_windows(data, tok, LENGTH, STRIDE)
    assert [len(ws) for ws in docs] == [1, 1, 1]
    assert [ws[0] for ws in docs] == encode(data, tok, LENGTH)


def test_windows_need_room_beside_the_special_tokens(folder):
    tok = load_classifier(folder, ["neg", "pos"]).tokenizer
    with pytest.raises(DPFitError, match="special tokens"):
        encode_windows(_texts([30]), tok, LENGTH, 2)


# -- evaluation: one prediction per text ------------------------------------------------------


class _Counter(torch.nn.Module):
    """Logits (bad words, good words) of the window: a text whose windows disagree is
    decided by their mean, not by its first window."""

    def __init__(self, tok):
        super().__init__()
        self.good, self.bad = tok.convert_tokens_to_ids(["good", "bad"])

    def forward(self, input_ids, attention_mask=None, **kw):
        good = ((input_ids == self.good) * attention_mask).sum(1).double()
        bad = ((input_ids == self.bad) * attention_mask).sum(1).double()
        return type("Out", (), {"logits": torch.stack([bad, good], 1)})()


def test_mean_window_logits_per_document():
    logits = torch.tensor([[1.0, 0.0], [0.0, 3.0], [2.0, 0.0], [5.0, 1.0]])
    owner = torch.tensor([0, 0, 0, 1])
    got = mean_window_logits(logits, owner, 2)
    assert torch.equal(got, torch.tensor([[1.0, 1.0], [5.0, 1.0]]))


def test_a_text_is_predicted_from_the_mean_of_its_windows(folder):
    tok = load_classifier(folder, ["neg", "pos"]).tokenizer
    # text 0: its first window all "bad" (3), the next two hold 8 "good" (label pos);
    # text 1: one window, "good" (label neg: wrong); text 2: "bad" then one "good" (neg)
    texts = (
        "bad bad bad " + "the " * 11 + "good " * 8,
        "good film",
        "bad bad " + "the " * 12 + "good",
    )
    data = LabeledTexts(texts, (1, 0, 0), ("neg", "pos"))
    docs = encode_windows(data, tok, LENGTH, LENGTH)
    assert [len(ws) for ws in docs] == [2, 1, 2]
    res = evaluate(_Counter(tok), tok, data, LENGTH, batch_size=2, stride=LENGTH)
    assert res.n == 3  # texts, not windows
    assert res.accuracy == pytest.approx(2 / 3)
    assert res.per_class["pos"] == {"n": 1, "correct": 1, "predicted": 2}
    # without windows the first text is truncated to its "bad" start: predicted neg
    assert evaluate(_Counter(tok), tok, data, LENGTH, batch_size=2).accuracy == pytest.approx(1 / 3)


# -- the document unit against the oracle ----------------------------------------------------

# texts of 3, 2 and 1 windows; physical batches of 2: the 3-window text spans two of them
DOC_WORDS = (30, 20, 9)


def _tiny_classifier(folder):
    """The tiny BERT classifier in float64, without dropout, with a random head (a zero head
    passes no gradient to the biases) and random biases; biases + head trainable."""
    loaded = load_classifier(folder, ["neg", "pos"], seed=0)
    model = loaded.model.double().eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or any(name.startswith(h) for h in loaded.head_names):
                p.normal_(0, 0.3)
    dpfit.make_bias_trainable(model, train_head=loaded.head_names)
    return model, loaded.tokenizer


def _oracle_documents(model, tok, data: LabeledTexts) -> torch.Tensor:
    """(documents, trainable elements): each window run alone (cut here from the raw token
    ids, not by the code under test), its gradient taken, summed per document."""
    params = [p for p in model.parameters() if p.requires_grad]
    body, step = LENGTH - 2, STRIDE - 2
    out = []
    for text, y in zip(data.texts, data.labels, strict=True):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        starts = [0]
        while starts[-1] + body < len(ids):
            starts.append(starts[-1] + step)
        total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
        for s in starts:
            x = torch.tensor([[tok.cls_token_id, *ids[s : s + body], tok.sep_token_id]])
            loss = model(
                input_ids=x, attention_mask=torch.ones_like(x), token_type_ids=torch.zeros_like(x),
                labels=torch.tensor([y]),
            ).loss  # fmt: skip
            grads = torch.autograd.grad(loss, params)
            total += torch.cat([g.flatten() for g in grads])
        out.append(total)
    return torch.stack(out)


def _released(folder, data: LabeledTexts, max_grad_norm: float) -> torch.Tensor:
    """One logical step (q = 1, noise 0) of the engine over the task's document items."""
    model, tok = _tiny_classifier(folder)
    task = ClassificationTask()
    cfg = TrainConfig(max_length=LENGTH, stride=STRIDE, privacy_unit="document")
    split = PreparedData(train=data, test=data, notes=())
    prep = Prepared(model, tok, len(data), 2, (), state={"data": split, "pooling": "cls"})
    task._cut_into_windows(prep, cfg)  # as ClassificationTask.prepare does
    assert prep.n == len(data) and prep.privacy_unit == "document"
    items = task.items(prep, LENGTH)
    assert sorted(len(ws) for ws in items) == [1, 2, 3]
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=len(data), sample_size=len(data), noise_multiplier=0.0,
        max_grad_norm=max_grad_norm, clipping="flat", privacy_unit="document",
    )  # fmt: skip
    opt = Capture(engine.parameters())
    loader = engine.data_loader(
        items, task.collate(prep, False), physical_batch_size=2, optimizer=opt
    )
    batches = 0
    for batch in loader:
        task.loss(model, batch).backward()
        batches += 1
        if engine.step(opt):
            break
    assert batches == 3  # 6 windows in physical batches of 2
    engine.detach()
    return torch.cat([opt.grads[p].flatten() for p in engine.parameters()])


@pytest.fixture(scope="module")
def oracle(folder):
    data = _texts(DOC_WORDS, labels=[1, 0, 1])
    model, tok = _tiny_classifier(folder)
    return data, _oracle_documents(model, tok, data)


def test_document_unit_unclipped_is_the_sum_of_window_gradients(folder, oracle):
    data, grads = oracle
    got = _released(folder, data, max_grad_norm=1e6)
    assert_close_to_oracle(got, grads.sum(0) / len(data))


def test_document_unit_clipped_as_one_contribution(folder, oracle):
    """R below every document's norm: each text contributes exactly R / B in the direction of
    its windows' summed gradient, however many windows or physical batches it spans."""
    data, grads = oracle
    r = 0.25 * float(grads.norm(dim=1).min())
    got = _released(folder, data, max_grad_norm=r)
    factors = (r / grads.norm(dim=1)).clamp(max=1.0)
    assert_close_to_oracle(got, (factors[:, None] * grads).sum(0) / len(data))


# -- the run end to end ----------------------------------------------------------------------


def _long_csv(path, n: int, seed: int) -> str:
    """Reviews of 4 to 60 words (one to five windows of 16 tokens), the label in a word that
    can sit anywhere in the text."""
    rng = random.Random(seed)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for _ in range(n):
            y = rng.random() < 0.5
            words = rng.choices(("the", "movie", "plot", "was", "a", "it"), k=rng.randint(3, 59))
            words.insert(rng.randrange(len(words) + 1), "good" if y else "bad")
            w.writerow([" ".join(words), "pos" if y else "neg"])
    return str(path)


def _args(folder, data, out, *extra) -> list[str]:
    return [
        "train", "--model", str(folder), "--data", data, "--max-length", str(LENGTH),
        "--batch-size", "8", "--physical-batch-size", "4", "--epochs", "1", "--epsilon", "4",
        "--threads", "1", "--quiet", "--output", str(out), *extra,
    ]  # fmt: skip


def test_cli_document_unit_end_to_end(folder, tmp_path, capsys):
    data = _long_csv(tmp_path / "long.csv", 80, seed=0)
    out = tmp_path / "doc"
    args = _args(folder, data, out, "--stride", str(STRIDE), "--privacy-unit", "document")
    assert main(args) == 0
    table = capsys.readouterr().out
    m = json.loads((out / "metrics.json").read_text())
    train_docs = (
        ClassificationTask()
        .prepare(TrainConfig(model=str(folder), data=data, max_length=LENGTH, stride=STRIDE))
        .state["data"]
        .train
    )
    n_docs = len(train_docs)  # 80 rows, about a tenth held out (each row by its own hash)
    assert 60 <= n_docs <= 78
    assert m["privacy_unit"] == "document" and m["train_documents"] == n_docs
    assert m["train_examples"] == n_docs and m["sample_rate"] == pytest.approx(8 / n_docs)
    assert m["window_length"] == LENGTH and m["stride"] == STRIDE
    assert m["eval_n"] == 80 - n_docs and m["steps"] == round(n_docs / 8)
    assert 0 < m["epsilon"] <= 4.0 * 1.001
    assert m["head_first_steps"] == 0  # no probe on single windows under the document unit
    record = json.loads((out / "model" / "dpfit.json").read_text())
    assert record["privacy_unit"] == "document" and record["sample_size"] == n_docs
    assert "document (all its windows" in table and f"{n_docs} documents" in table
    assert "texts (each from the mean of its windows' logits)" in table
    # the window count follows the private texts' lengths: not published under this unit
    n_windows = sum(
        len(ws)
        for ws in encode_windows(
            train_docs, load_classifier(folder, ["neg", "pos"]).tokenizer, LENGTH, STRIDE
        )
    )
    assert n_windows > n_docs
    assert f"{n_windows} windows" not in json.dumps(m) + table


def test_window_unit_counts_windows_and_says_what_epsilon_protects(folder, tmp_path):
    data = _long_csv(tmp_path / "long.csv", 80, seed=0)
    notes: list[str] = []
    cfg = TrainConfig(
        model=str(folder), data=data, max_length=LENGTH, stride=STRIDE, batch_size=8,
        physical_batch_size=4, max_steps=2, epsilon=4.0,
    )  # fmt: skip
    res = train(cfg, on_note=notes.append)
    m = res.metrics
    n_docs = m["train_documents"]  # 80 rows, about a tenth held out (each by its own hash)
    assert m["privacy_unit"] == "window" and 60 <= n_docs <= 78 and m["eval_n"] == 80 - n_docs
    assert m["train_examples"] > n_docs  # n: the windows
    assert m["sample_rate"] == pytest.approx(8 / m["train_examples"])
    rows = dict(summary_rows(m))
    assert "epsilon protects a window, not a document" in rows["privacy unit"]
    assert any(f"{m['train_examples']} windows" in n and "one window" in n for n in notes)


def test_non_private_baseline_trains_on_the_same_windows(folder, tmp_path):
    data = _long_csv(tmp_path / "long.csv", 40, seed=2)
    cfg = TrainConfig(
        model=str(folder), data=data, max_length=LENGTH, stride=STRIDE, batch_size=8,
        physical_batch_size=4, max_steps=2, non_private=True, public_labels=True,
    )  # fmt: skip
    m = train(cfg).metrics
    n_docs = m["train_documents"]  # 40 rows, about a tenth held out (each by its own hash)
    assert 28 <= n_docs <= 39 and m["train_examples"] > n_docs and m["eval_n"] == 40 - n_docs
    assert m["steps"] == 2 and "privacy_unit" not in m


def test_short_texts_train_exactly_as_without_windows(tiny):
    """Texts within max length are one window each: with --stride the run trains and scores
    exactly as without it (same items, same order, same noise under a fixed seed)."""
    base = dict(
        model=tiny[0], data=tiny[1], max_length=32, max_steps=3, batch_size=32,
        physical_batch_size=16, insecure_reproducible_noise=True, seed=3,
    )  # fmt: skip
    a = train(TrainConfig(**base))
    b = train(TrainConfig(**base, stride=20))
    assert b.metrics["privacy_unit"] == "window" and "privacy_unit" in a.metrics
    assert a.metrics["privacy_unit"] == "example"
    for key in ("accuracy", "epsilon", "sample_rate", "train_examples", "eval_n", "per_class"):
        assert a.metrics[key] == b.metrics[key], key
    pa = dict(a.model.named_parameters())
    for name, p in b.model.named_parameters():
        assert torch.equal(p, pa[name]), name


@pytest.mark.parametrize(
    "changes,match",
    [
        ({"privacy_unit": "document", "mode": "full"}, "--mode bias"),
        ({"privacy_unit": "document", "mode": "lora"}, "--mode bias"),
        ({"stride": 65, "max_length": 64}, "--stride 65 is more than --max-length 64"),
        ({"privacy_unit": "document", "non_private": True}, "--privacy-unit window"),
        ({"privacy_unit": "document", "head_first": True}, "--head-first"),
        ({"task": "image-classification", "stride": 8}, "causal-lm or classification"),
    ],
)
def test_bad_combinations_are_refused_before_reading_data(changes, match):
    with pytest.raises(DPFitError, match=match):
        train(TrainConfig(data="/nonexistent.csv", **changes))


def test_default_stride_longer_than_the_models_window_is_refused(folder, tmp_path):
    """Without --max-length the window is the recipe's length lowered to the model's (64):
    a longer --stride is refused once that is known, before training."""
    data = _long_csv(tmp_path / "long.csv", 20, seed=1)
    with pytest.raises(DPFitError, match="--stride 100 is more than --max-length 64"):
        train(TrainConfig(model=str(folder), data=data, stride=100, public_labels=True))

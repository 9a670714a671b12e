"""Sequence classification as a task plug-in: labelled texts, a pooled head, accuracy.

Label names are published (model/config.json, metrics.json), so they come from the user
(``labels``), from the bundled data, or from the training file only when every name is
frequent (or the user declares them public): see docs/threat-model.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dpfit import progress
from dpfit.data.text import LabeledTexts, bundled_rotten_tomatoes, load_texts
from dpfit.errors import DPFitError
from dpfit.models import load_classifier
from dpfit.tasks import Prepared
from dpfit.tasks.labels import (  # noqa: F401 - the first two re-exported
    MIN_PUBLIC_LABEL_COUNT,
    RareLabelError,
    check_data_label_names,
)

if TYPE_CHECKING:
    from dpfit.train import TrainConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    n: int
    per_class: dict[str, dict[str, int]]  # name -> {"n", "correct", "predicted"}

    def as_dict(self) -> dict:
        return {"accuracy": self.accuracy, "n": self.n, "per_class": self.per_class}


@dataclass(frozen=True)
class PreparedData:
    train: LabeledTexts
    test: LabeledTexts
    notes: tuple[str, ...]


def prepare_data(config: TrainConfig) -> PreparedData:
    """Training and evaluation texts for `config`, with notes on any subsampling or split."""
    notes: list[str] = []
    if config.data is None:
        splits = bundled_rotten_tomatoes(seed=config.seed)
        train, test = splits.train, splits.test
        notes.append(
            f"data: bundled Rotten Tomatoes, split by movie (seed {config.seed}): "
            f"{len(splits.train)} train / {len(splits.validation)} validation / {len(test)} test"
        )
        notes.append("label names: the bundled data's own (rotten, fresh), public")
    else:
        train = load_texts(
            config.data,
            config.text_column,
            config.label_column,
            label_names=config.labels,
            label_ids=config.labels is not None,  # number k in the file: the k-th --labels name
        )
        label_note_at = len(notes)  # the gate counts the rows that train: after split/subset
        if config.eval_data is None:
            if len(train) < 10:
                raise DPFitError(
                    f"{config.data} has {len(train)} examples, too few to hold out a test "
                    "set; pass --eval-data"
                )
            train, test = train.split(0.1, seed=config.seed)
            notes.append(
                f"no --eval-data: holding out a random 10% of {config.data} as the test set "
                f"({len(test)} examples)"
            )
    if config.eval_data is not None:
        test = load_texts(
            config.eval_data, config.text_column, config.label_column, label_names=train.label_names
        )
    if config.max_train_examples is not None and config.max_train_examples < len(train):
        notes.append(
            f"training on a random {config.max_train_examples} of {len(train)} training examples "
            "(--full-data or --max-train-examples to change)"
        )
        train = train.subsample(config.max_train_examples, seed=config.seed)
    if config.data is not None:
        notes.insert(label_note_at, _public_label_note(train, config))
    return PreparedData(train, test, tuple(notes))


def _public_label_note(train: LabeledTexts, config: TrainConfig) -> str:
    """Label names are released (model/config.json id2label, metrics.json per_class): say
    where they came from, and refuse names read from the data that few examples carry.
    `train` is what trains (after the hold-out and --max-train-examples): rows held out or
    left unsampled do not make a name common among the examples the model learns from."""
    if config.labels is not None:
        return f"label names (public, from --labels): {', '.join(train.label_names)}"
    return check_data_label_names(
        train.label_names,
        train.class_counts(),
        str(config.data),
        config.public_labels,
        "model/config.json and metrics.json",
    )


ENCODE_CHUNK = 4096  # texts per tokenizer call: progress on large files, same result


def encode(data: LabeledTexts, tokenizer, max_length: int) -> list[dict]:
    """Tokenise once up front; items are unpadded so each batch pads only to its own length."""
    items: list[dict] = []
    n = len(data)
    for start in range(0, n, ENCODE_CHUNK):
        progress.report("tokenising", start, n)
        texts = list(data.texts[start : start + ENCODE_CHUNK])
        enc = tokenizer(texts, truncation=True, max_length=max_length)
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
        labels = data.labels[start : start + ENCODE_CHUNK]
        items += [{**{k: enc[k][i] for k in keys}, "labels": y} for i, y in enumerate(labels)]
    progress.report("tokenising", n, n)
    return items


def make_collate(pad_token_id: int, position_ids: bool = False) -> Callable[[list[dict]], dict]:
    """Pad a list of encoded examples. With `position_ids`, also pass them per example: full
    mode needs every input with its batch axis (a broadcast (1, L) one mixes examples)."""

    def collate(items: list[dict]) -> dict:
        width = max((len(it["input_ids"]) for it in items), default=0)
        out: dict[str, torch.Tensor] = {}
        for key in items[0] if items else ():
            if key == "labels":
                out[key] = torch.tensor([it[key] for it in items], dtype=torch.long)
                continue
            pad = pad_token_id if key == "input_ids" else 0
            out[key] = torch.tensor(
                [it[key] + [pad] * (width - len(it[key])) for it in items], dtype=torch.long
            )
        if position_ids and items:
            out["position_ids"] = torch.arange(width).expand(len(items), width).clone()
        return out

    return collate


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    data: LabeledTexts,
    max_length: int = 128,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
) -> EvalResult:
    """Accuracy and per-class counts; batches sorted by length so padding costs little."""
    items = encode(data, tokenizer, max_length)
    order = sorted(range(len(items)), key=lambda i: len(items[i]["input_ids"]))
    collate = make_collate(tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    preds = [0] * len(items)
    progress.report("evaluating", 0, len(order))
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = collate([items[i] for i in idx])
        batch.pop("labels")
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        for i, p in zip(idx, logits.argmax(-1).tolist(), strict=True):
            preds[i] = p
        progress.report("evaluating", start + len(idx), len(order))
    model.train(was_training)
    per_class = {n: {"n": 0, "correct": 0, "predicted": 0} for n in data.label_names}
    correct = 0
    names = data.label_names
    for p, y in zip(preds, data.labels, strict=True):
        per_class[names[y]]["n"] += 1
        if 0 <= p < len(names):
            per_class[names[p]]["predicted"] += 1
        if p == y:
            per_class[names[y]]["correct"] += 1
            correct += 1
    return EvalResult(correct / len(items) if items else float("nan"), len(items), per_class)


def label_source(config) -> str:
    if config.data is None:
        return "bundled"
    if config.labels is not None:
        return "--labels"
    return "--public-labels" if config.public_labels else "training data (each name frequent)"


class ClassificationTask:
    """Texts -> backbone -> pooling -> linear head; cross-entropy; accuracy."""

    name = "classification"

    def prepare(self, config) -> Prepared:
        data = prepare_data(config)
        loaded = load_classifier(
            config.model, data.train.label_names, seed=config.seed, pooling=config.pooling
        )
        notes = [
            *data.notes,
            f"head: {loaded.pooling} pooling ({loaded.pooling_reason}), "
            + ("the saved model's trained linear layer" if loaded.head_trained
               else "zero-initialised linear layer"),
        ]  # fmt: skip
        return Prepared(
            model=loaded.model,
            tokenizer=loaded.tokenizer,
            n=len(data.train),
            num_classes=data.train.num_labels,
            head_names=loaded.head_names,
            notes=notes,
            state={"data": data, "pooling": loaded.pooling},
            starts_trained=loaded.head_trained,
        )

    def items(self, prep: Prepared, max_length: int) -> list[dict]:
        # Sorted by length: the Poisson loader yields each logical batch in index order, so its
        # physical batches hold examples of similar length and pad little (about half the
        # tokens of a random split on short texts). The order never leaves the process.
        items = encode(prep.state["data"].train, prep.tokenizer, max_length)
        return sorted(items, key=lambda item: len(item["input_ids"]))

    def collate(self, prep: Prepared, position_ids: bool) -> Callable[[list[dict]], dict]:
        return make_collate(prep.tokenizer.pad_token_id, position_ids=position_ids)

    def loss(self, model, batch: dict) -> torch.Tensor:
        return model(**batch).loss

    def evaluate(self, prep: Prepared, model, config, device) -> dict:
        data = prep.state["data"]
        res = evaluate(
            model, prep.tokenizer, data.test, config.max_length, config.eval_batch_size, device
        )
        return {
            "accuracy": res.accuracy,
            "eval_n": res.n,
            "per_class": res.per_class,
            "eval_source": data.test.source,
            "train_examples": len(data.train),
            "pooling": prep.state["pooling"],
            "label_names_public": True,
            "label_names_source": label_source(config),
        }

    def save(self, prep: Prepared, model, folder: Path) -> None:
        from dpfit.tasks.pooling import PooledClassifier, save_pooled_classifier

        if isinstance(model, PooledClassifier):
            save_pooled_classifier(model, prep.tokenizer, folder)
        else:  # pragma: no cover - the loop always builds a PooledClassifier
            model.save_pretrained(folder)
            prep.tokenizer.save_pretrained(folder)

"""Training jobs the overhead benchmarks share, so that the one-process figures
(engine_overhead.py) and the data-parallel ones (distributed.py) measure the same model on
the same data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MINILM_MAX_LENGTH = 128  # the product's default maximum length (tokens per example)


@dataclass(frozen=True)
class Workload:
    """One model's training job: a fresh bias-only model, its data, collate and loss."""

    make_model: Callable[[], Any]
    data: Any
    collate: Callable[[list], Any]
    loss: Callable[[Any, Any], Any]  # (model, batch) -> scalar loss
    rows: Callable[[Any], int]  # examples in a batch


def minilm_workload(max_length: int = MINILM_MAX_LENGTH) -> Workload:
    """The bundled all-MiniLM-L6-v2 classifier as `dpfit train` runs it (biases + the new
    head, train mode) on the bundled Rotten Tomatoes texts, every example padded or cut to
    `max_length` tokens, so each batch costs the same."""
    import dpfit
    from dpfit.data.text import bundled_rotten_tomatoes
    from dpfit.models import load_classifier
    from dpfit.tasks.classification import make_collate

    def make_model():
        loaded = load_classifier(None, ["rotten", "fresh"], seed=0)
        dpfit.make_bias_trainable(loaded.model, train_head=loaded.head_names)
        loaded.model.train()  # as dpfit train runs it (dropout on)
        return loaded.model

    tokenizer = load_classifier(None, ["rotten", "fresh"], seed=0).tokenizer
    train = bundled_rotten_tomatoes(seed=0).train
    enc = tokenizer(
        list(train.texts), truncation=True, padding="max_length", max_length=max_length
    )  # fmt: skip
    keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
    data = [{**{k: enc[k][i] for k in keys}, "labels": y} for i, y in enumerate(train.labels)]
    return Workload(
        make_model=make_model,
        data=data,
        collate=make_collate(tokenizer.pad_token_id),
        loss=lambda model, b: model(**b).loss,
        rows=lambda b: len(b["labels"]),
    )

"""Audit set-up for a text classifier the way `dpfit train` builds it: the same data loading,
model loading, bias-only selection (+ new head), tokenisation and padding collate.

Black-box canaries are held-out texts with a wrong label (mislabelled examples). White-box
canaries go into the biases of `targets` (default: the largest Linear bias and the first
LayerNorm, so two layer families are covered).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dpfit.audit.bounds import AuditError


@dataclass
class TextAuditSetup:
    model: nn.Module
    items: list[dict]  # real training examples (encoded)
    canary_items: list[dict]  # black-box canaries (encoded, mislabelled)
    collate: object
    targets: list[str]
    notes: list[str]


def classifier_losses(model: nn.Module, batch: dict) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return F.cross_entropy(model(**inputs).logits.float(), batch["labels"], reduction="none")


def default_targets(model: nn.Module) -> list[str]:
    """The Linear with the largest trainable bias and the first LayerNorm with one."""
    linears = [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and m.bias is not None and m.bias.requires_grad
    ]
    norms = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.LayerNorm) and m.bias is not None and m.bias.requires_grad
    ]
    if not linears:
        raise AuditError("the model has no Linear with a trainable bias; give --targets")
    out = [max(linears, key=lambda t: t[1].bias.numel())[0]]
    if norms:
        out.append(norms[0])
    return out


def prepare_text_audit(
    model_name: str | None,
    data: str | None,
    real_examples: int,
    canaries: int,
    max_length: int,
    text_column: str = "text",
    label_column: str = "label",
    targets: Sequence[str] | None = None,
    seed: int = 0,
) -> TextAuditSetup:
    import dpfit
    from dpfit.models import load_classifier
    from dpfit.train import TrainConfig, encode, make_collate, prepare_data

    cfg = TrainConfig(
        model=model_name,
        data=data,
        text_column=text_column,
        label_column=label_column,
        max_train_examples=real_examples,
        max_length=max_length,
        seed=seed,
    )
    prepared = prepare_data(cfg)
    loaded = load_classifier(model_name, prepared.train.label_names, seed=seed)
    model = loaded.model
    dpfit.make_bias_trainable(model, train_head=loaded.head_names)
    items = encode(prepared.train, loaded.tokenizer, max_length)
    held = encode(prepared.test, loaded.tokenizer, max_length)
    if len(held) < canaries:
        raise AuditError(
            f"black-box canaries are held-out texts: {len(held)} available, {canaries} asked; "
            "lower --canaries-count"
        )
    k = len(prepared.train.label_names)
    canary_items = [
        {**it, "labels": (it["labels"] + 1) % k} for it in held[:canaries]
    ]  # mislabelled
    chosen = list(targets) if targets else default_targets(model)
    return TextAuditSetup(
        model=model,
        items=items,
        canary_items=canary_items,
        collate=make_collate(loaded.tokenizer.pad_token_id),
        targets=chosen,
        notes=list(prepared.notes),
    )

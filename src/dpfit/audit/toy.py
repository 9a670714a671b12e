"""A small synthetic bias-only classifier: a fast audit target for tests and benchmarks.

Two layer families carry trained biases (Linear and LayerNorm), so faults specific to one family
can be placed under canaries. Weights are frozen, as in DP-BiTFiT.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

TOY_TARGETS = ("0", "2")  # the first Linear and the LayerNorm


def toy_model(width: int = 256, inputs: int = 16, classes: int = 2, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(inputs, width), nn.Tanh(), nn.LayerNorm(width), nn.Linear(width, classes)
    )
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("bias"))
    return model


def toy_items(n: int, inputs: int = 16, seed: int = 0) -> list[dict]:
    """n labelled points of a noisy linear rule."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inputs, generator=gen)
    w = torch.randn(inputs, generator=gen)
    y = ((x @ w + 0.5 * torch.randn(n, generator=gen)) > 0).long()
    return [{"x": x[i], "labels": int(y[i])} for i in range(n)]


def toy_canary_items(m: int, inputs: int = 16, seed: int = 1) -> list[dict]:
    """Out-of-distribution inputs (10x the scale) with random labels: black-box canaries."""
    gen = torch.Generator().manual_seed(seed)
    x = 10 * torch.randn(m, inputs, generator=gen)
    y = torch.randint(0, 2, (m,), generator=gen)
    return [{"x": x[i], "labels": int(y[i])} for i in range(m)]


def toy_collate(rows: list[dict]) -> dict:
    return {
        "x": torch.stack([r["x"] for r in rows]),
        "labels": torch.tensor([r["labels"] for r in rows], dtype=torch.long),
    }


def toy_losses(model: nn.Module, batch: dict) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["labels"], reduction="none")

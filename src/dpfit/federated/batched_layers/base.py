"""What a layer family gives the batched engine: the frozen part's output, and the trained
part as a function of parameters stacked on a leading client axis.

One module per model family (``bert``, ...), registered in ``batched_layers/__init__.py``;
the engine (``federated/batched.py``) runs any of them and none imports it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from dpfit.federated.client import ClientTaskError, LocalModel


class BatchedEngineError(ClientTaskError):
    """The model or local mode cannot be simulated by the batched engine."""


@dataclass(frozen=True)
class Linear:
    """Names of one linear layer's parameters (and its LoRA factors, if any)."""

    weight: str
    bias: str | None
    lora_a: str | None = None
    lora_b: str | None = None
    scaling: float = 0.0


class TrainedTop(ABC):
    """The layers that train (and the head), for one local mode of one model family.

    ``trainable``: the names of the stacked client tensors, in ``LocalModel.trainable`` order.
    ``qkv_weight``: the first trained layer's frozen query/key/value weights stacked (its
    input's products with them are cached per text), or None.
    """

    trainable: list[str]
    qkv_weight: torch.Tensor | None
    named: dict[str, torch.nn.Parameter]  # the model's parameters by name (set by a family)

    def __init__(self, lm: LocalModel) -> None:
        self.lm = lm

    def _name(self, name: str) -> str:
        if name not in self.named:
            raise BatchedEngineError(f"expected parameter {name} in the model")
        return name

    def _get(self, name: str, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """A stacked client tensor if it trains, else the frozen weight."""
        return params[name] if name in params else self.named[name].detach()

    def _apply(
        self,
        lin: Linear,
        x: torch.Tensor,
        params: dict[str, torch.Tensor],
        base: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x (K, N, in) -> (K, N, out); stacked (K, ...) tensors are per client. ``base``: the
        cached x W^T of a frozen W (then only the bias and LoRA terms are computed)."""
        if base is not None:
            y = base
        else:
            w = self._get(lin.weight, params)
            y = x @ w.transpose(-1, -2) if w.dim() == 2 else torch.bmm(x, w.transpose(1, 2))
        if lin.bias is not None:
            b = self._get(lin.bias, params)
            y = y + (b if b.dim() == 1 else b[:, None, :])
        if lin.lora_a is not None:
            a, bb = self._get(lin.lora_a, params), self._get(lin.lora_b, params)
            at = a.transpose(-1, -2)
            xa = x @ at if a.dim() == 2 else torch.bmm(x, at)
            bt = bb.transpose(-1, -2)
            y = y + lin.scaling * (xa @ bt if bb.dim() == 2 else torch.bmm(xa, bt))
        return y

    @abstractmethod
    def frozen_hidden(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, L, H): the input of the first trained layer, from the frozen layers below it."""

    @abstractmethod
    def logits(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        projected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden (K, B, L, H), mask (K, B, L) or None -> logits (K, B, classes)."""

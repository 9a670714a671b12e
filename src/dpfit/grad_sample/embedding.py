"""nn.Embedding weights: explicit per-example gradients (scatter of the output gradient).

Used when an embedding trains outside full mode (e.g. new token rows next to the biases). An
embedding has no bias, so in bias-only training it is never hooked. In full mode the factored
sampler in :mod:`dpfit.grad_sample.full` is used instead: it never builds the [B, V, d] tensor
this one returns.
"""

from __future__ import annotations

import torch
from torch import nn

from dpfit.grad_sample.full import OuterGrad, embedding_factors
from dpfit.grad_sample.registry import register_weight_sampler


@register_weight_sampler(nn.Embedding)
def embedding_weight(
    layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, batch_dim: int
) -> dict:
    x, y = embedding_factors(layer, inputs, grad_output, batch_dim)
    return {"weight": OuterGrad(((x, y),), layer.weight.shape).materialize()}

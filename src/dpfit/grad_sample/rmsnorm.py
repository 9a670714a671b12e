"""RMSNorm: weights (full mode) and the shift that DP-BiTFiT-Add puts after the scale.

LLaMA-style models normalise without a shift, so they have no bias to train.
:class:`RMSNormWithBias` is the same computation as transformers' ``LlamaRMSNorm`` plus a
zero-initialised ``bias`` added after the scale; its parameters keep the names ``weight`` and
``bias`` so a saved state dict reads like any norm layer's. ``dpfit.add_biases`` swaps it in
only after checking, on a probe input, that it reproduces the original layer bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpfit.grad_sample.registry import (
    move_batch_first,
    register_bias_sampler,
    register_weight_sampler,
    sum_positions,
)

# transformers' LLaMA-family RMSNorms share one formula (normalise in float32, cast back, scale).
LLAMA_STYLE_RMSNORMS = tuple(
    f"transformers.models.{m}.modeling_{m}.{c}RMSNorm"
    for m, c in (
        ("llama", "Llama"),
        ("mistral", "Mistral"),
        ("qwen2", "Qwen2"),
        ("qwen3", "Qwen3"),
        ("olmo2", "Olmo2"),
        ("phi3", "Phi3"),
    )
)


def llama_rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` exactly as LlamaRMSNorm computes it (float32 inside, input dtype out)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype)


class RMSNormWithBias(nn.Module):
    """``weight * x / rms(x) + bias`` (LLaMA formula), the bias zero at creation."""

    def __init__(self, weight: nn.Parameter, eps: float, bias: nn.Parameter | None = None):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps
        self.bias = bias if bias is not None else nn.Parameter(torch.zeros_like(weight))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        normed = llama_rms_normalize(hidden_states, self.variance_epsilon)
        return self.weight * normed + self.bias

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, bias=True"


@register_bias_sampler(RMSNormWithBias)
def rmsnorm_bias(layer: nn.Module, grad_output: torch.Tensor, batch_dim: int) -> dict:
    return {"bias": sum_positions(grad_output, batch_dim)}


@register_weight_sampler(RMSNormWithBias, *LLAMA_STYLE_RMSNORMS)
def llama_rmsnorm_weight(
    layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, batch_dim: int
) -> dict:
    normed = llama_rms_normalize(inputs, layer.variance_epsilon)
    return {"weight": sum_positions(grad_output * normed, batch_dim)}


@register_weight_sampler(nn.RMSNorm)
def torch_rmsnorm_weight(
    layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, batch_dim: int
) -> dict:
    normed = F.rms_norm(inputs, layer.normalized_shape, eps=layer.eps)
    prod = move_batch_first(grad_output * normed, batch_dim)
    n = len(layer.normalized_shape)
    dims = list(range(1, prod.dim() - n))
    return {"weight": prod.sum(dim=dims) if dims else prod}

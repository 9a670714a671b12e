"""Linear layers: nn.Linear and transformers' Conv1D (GPT-2), any input rank."""

from __future__ import annotations

import torch
from torch import nn

from dpfit.grad_sample.registry import (
    move_batch_first,
    register_bias_sampler,
    register_weight_sampler,
    sum_positions,
)

HF_CONV1D = "transformers.pytorch_utils.Conv1D"


@register_bias_sampler(nn.Linear, HF_CONV1D)
def linear_bias(layer: nn.Module, grad_output: torch.Tensor, batch_dim: int) -> dict:
    return {"bias": sum_positions(grad_output, batch_dim)}


def _flatten_positions(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1, t.shape[-1])


@register_weight_sampler(nn.Linear)
def linear_weight(
    layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, batch_dim: int
) -> dict:
    if inputs.dim() == 2 and batch_dim == 0:
        # no positions (a classification head): one outer product per example, the same
        # products as the einsum below without its set-up (a third of its time at 16 x 10 x 64)
        return {"weight": grad_output.unsqueeze(2) * inputs.unsqueeze(1)}
    a = _flatten_positions(move_batch_first(inputs, batch_dim))
    g = _flatten_positions(move_batch_first(grad_output, batch_dim))
    return {"weight": torch.einsum("bto,bti->boi", g, a)}


@register_weight_sampler(HF_CONV1D)
def conv1d_hf_weight(
    layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, batch_dim: int
) -> dict:
    a = _flatten_positions(move_batch_first(inputs, batch_dim))
    g = _flatten_positions(move_batch_first(grad_output, batch_dim))
    return {"weight": torch.einsum("bti,bto->bio", a, g)}

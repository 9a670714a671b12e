"""Normalisation layers with an affine shift: LayerNorm, GroupNorm, InstanceNorm*d.

The bias enters after normalisation, so its per-example gradient is the output gradient summed
over the positions it is broadcast to. Weights (for a trainable head or full mode) need the
normalised input, recomputed from the layer's input.
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
    sum_to_channel,
)

INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def _layer_norm_sum_dims(layer: nn.LayerNorm, g: torch.Tensor) -> list[int]:
    n = len(layer.normalized_shape)
    return list(range(1, g.dim() - n))


@register_bias_sampler(nn.LayerNorm)
def layer_norm_bias(layer: nn.Module, grad_output: torch.Tensor, batch_dim: int) -> dict:
    return {"bias": sum_positions(grad_output, batch_dim, len(layer.normalized_shape))}


@register_weight_sampler(nn.LayerNorm)
def layer_norm_weight(
    layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, batch_dim: int
) -> dict:
    a = move_batch_first(inputs, batch_dim)
    g = move_batch_first(grad_output, batch_dim)
    normed = F.layer_norm(a, layer.normalized_shape, eps=layer.eps)
    prod = g * normed
    dims = _layer_norm_sum_dims(layer, g)
    return {"weight": prod.sum(dim=dims) if dims else prod}


@register_bias_sampler(nn.GroupNorm, *INSTANCE_NORMS, batch_axis_fixed=True)
def channel_norm_bias(layer: nn.Module, grad_output: torch.Tensor, batch_dim: int) -> dict:
    return {"bias": sum_to_channel(grad_output, 1)}


@register_weight_sampler(nn.GroupNorm)
def group_norm_weight(
    layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, batch_dim: int
) -> dict:
    normed = F.group_norm(inputs, layer.num_groups, eps=layer.eps)
    return {"weight": sum_to_channel(grad_output * normed, 1)}


@register_weight_sampler(*INSTANCE_NORMS)
def instance_norm_weight(
    layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, batch_dim: int
) -> dict:
    normed = F.instance_norm(inputs, eps=layer.eps)
    return {"weight": sum_to_channel(grad_output * normed, 1)}

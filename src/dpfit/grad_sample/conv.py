"""Convolutions: Conv1d/2d/3d and ConvTranspose1d/2d/3d. Batch is axis 0, channels axis 1."""

from __future__ import annotations

import torch
from torch import nn

from dpfit.grad_sample.registry import register_bias_sampler, sum_to_channel

CONVS = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
)


@register_bias_sampler(*CONVS, batch_axis_fixed=True)
def conv_bias(layer: nn.Module, grad_output: torch.Tensor, batch_dim: int) -> dict:
    expected = {nn.Conv1d: 3, nn.ConvTranspose1d: 3, nn.Conv2d: 4, nn.ConvTranspose2d: 4}.get(
        type(layer), 5
    )
    if grad_output.dim() != expected:
        raise ValueError(
            f"{type(layer).__name__} got an unbatched input (rank {grad_output.dim() - 1}); "
            "dpfit needs a batch axis to separate examples"
        )
    return {"bias": sum_to_channel(grad_output, 1)}

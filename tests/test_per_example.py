"""The per-example hooks cost no activation-sized memory: the backward pass and step of
DP-BiTFiT on a GroupNorm CNN allocate, at their peak, what non-private bias-only training of
the same model does.

The bias samplers read each output gradient once, in the backward hook, and keep only [B, C]
sums. Keeping the gradient alive, copying it (a float64 or contiguous copy), or retaining the
graph would add at least one output-gradient-sized tensor to the backward pass's peak; the
bound below is a quarter of the smallest such tensor. The forward pass is left out of the
measured window: its saved activations would set the peak and hide the backward's.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import dpfit
from dpfit.memory import tensor_peak

BATCH, SIDE, WIDTH = 8, 32, 16


def gn_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, WIDTH, 3, padding=1, bias=False),
        nn.GroupNorm(4, WIDTH),
        nn.ReLU(),
        nn.Conv2d(WIDTH, WIDTH, 3, padding=1, bias=False),
        nn.GroupNorm(4, WIDTH),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(WIDTH, 10),
    )


def peak_after_forward(step) -> int:
    """Tensor peak of the backward pass and update of one step (`step()` runs the forward
    pass and returns the rest)."""
    return tensor_peak(step())


def test_dp_bitfit_step_peak_is_the_non_private_one():
    x = torch.randn(BATCH, 3, SIDE, SIDE)
    y = torch.randint(0, 10, (BATCH,))
    plain = gn_cnn()
    private = copy.deepcopy(plain)
    for m in (plain, private):
        dpfit.make_bias_trainable(m, train_head=["8"])
    opt_plain = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-3)
    engine = dpfit.PrivacyEngine(
        private, expected_batch_size=BATCH, sample_size=1000, noise_multiplier=1.0,
        sampling="user-poisson", insecure_seed=0,
    )  # fmt: skip
    opt_private = torch.optim.AdamW(engine.parameters(), lr=1e-3)

    def plain_step():
        loss = F.cross_entropy(plain(x), y)

        def finish():
            loss.backward()
            opt_plain.step()
            opt_plain.zero_grad(set_to_none=True)

        return finish

    def private_step():
        loss = F.cross_entropy(private(x), y)

        def finish():
            loss.backward()
            engine.step(opt_private, batch_size=BATCH)

        return finish

    for step in (plain_step, private_step) * 2:  # optimizer state, lazily built caches
        step()()
    base = peak_after_forward(plain_step)
    dp = peak_after_forward(private_step)
    one_gradient = BATCH * WIDTH * SIDE * SIDE * 4  # a GroupNorm output gradient, float32
    assert dp - base < one_gradient // 4, (dp, base)

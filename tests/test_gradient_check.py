"""The per-step gradient check: tolerant of rounding when per-example gradients cancel, still
strict about terms it did not see."""

from __future__ import annotations

import pytest
import torch
from oracle import make_engine
from torch import nn

import dpfit


def _cancelling_backward(model: nn.Module, batch: int = 64, positions: int = 128) -> None:
    """Large per-example output gradients of alternating sign: their sum is a tiny fraction of
    their size, as in a balanced binary task whose head already fits."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, positions, 8, generator=gen)
    sign = torch.tensor([1.0, -1.0]).repeat(batch // 2)[:, None, None]
    weight = 1000.0 * sign + 1e-3 * torch.randn(batch, positions, 8, generator=gen)
    (model(x) * weight).sum().backward()


@pytest.mark.parametrize("mode", ["bias", "full"])
def test_cancelling_per_example_gradients_pass(mode):
    model = nn.Linear(8, 8)
    if mode == "bias":
        dpfit.make_bias_trainable(model)
    engine = make_engine(model, mode=mode, max_grad_norm=1e9)
    _cancelling_backward(model)
    # the bias's sum is tiny against what was added, so the rounding of two summation orders
    # is far above 1e-3 of it
    assert model.bias.grad.norm().item() < 1e-3 * 64 * 128 * 1000
    engine.step(torch.optim.SGD(engine.parameters(), lr=0.0), batch_size=64)


def test_a_missed_term_is_caught_beside_cancelling_gradients():
    """The tolerance grows with what was added, so a missed use of the bias is still caught
    at 1% of that size. (A missed term that cancels across the batch as much as the rest is
    below rounding: no check of sums can tell it apart.)"""

    class Sneaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):  # a second use of the bias that no hook sees
            return self.lin(x), nn.functional.linear(x, self.lin.weight, self.lin.bias)

    model = Sneaky()
    dpfit.make_bias_trainable(model)
    engine = make_engine(model, max_grad_norm=1e9)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, 8, generator=gen)
    sign = torch.tensor([1.0, -1.0]).repeat(32)[:, None, None]
    seen, unseen = model(x)
    ((seen * 1000.0 * sign).sum() + 10.0 * unseen.sum()).backward()
    with pytest.raises(dpfit.GradientMismatchError, match="do not add up"):
        engine.step(torch.optim.SGD(engine.parameters(), lr=0.0), batch_size=64)

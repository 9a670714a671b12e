"""The shared per-example reductions: the matrix-product path equals torch's reduction."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_matches_oracle, engine_per_example, make_engine, oracle_per_example
from torch import nn

import dpfit
from dpfit.grad_sample import registry
from dpfit.grad_sample.registry import _matmul_sums, sum_positions, sum_to_channel
from dpfit.memory import tensor_peak


@pytest.fixture(params=["product", "reduction"])
def path(request, monkeypatch):
    """Both ways of summing, whatever the tensor's size (the product is used from a size up)."""
    monkeypatch.setattr(
        registry, "MATMUL_SUM_MIN_NUMEL", 0 if request.param == "product" else 1 << 62
    )
    return request.param


def reference(g: torch.Tensor, batch_dim: int, kept: int) -> torch.Tensor:
    g = g.movedim(batch_dim, 0).double()
    dims = list(range(1, g.dim() - kept))
    return g.sum(dims) if dims else g


@pytest.mark.parametrize(
    ("shape", "batch_dim", "kept"),
    [
        ((5, 7, 3), 0, 1),  # batch-first tokens
        ((7, 5, 3), 1, 1),  # sequence-first
        ((5, 2, 3, 4), 0, 1),  # several position axes
        ((5, 6, 2, 3), 0, 2),  # LayerNorm over the last two axes
        ((2, 5, 3, 4), 1, 1),  # positions both sides of the batch: plain reduction
        ((5, 3), 0, 1),  # no positions
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sum_positions_matches_reduction(shape, batch_dim, kept, dtype, path):
    g = torch.randn(shape, dtype=torch.float64).to(dtype)
    got = sum_positions(g, batch_dim, kept)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), reference(g, batch_dim, kept), rtol=1e-5, atol=1e-6)


def test_sum_to_channel_axis_one_matches_reduction(path):
    g = torch.randn(4, 3, 5, 6)
    want = g.double().sum((2, 3))
    torch.testing.assert_close(sum_to_channel(g, 1).double(), want, rtol=1e-5, atol=1e-6)


def test_product_only_where_it_is_as_exact(monkeypatch):
    monkeypatch.setattr(registry, "MATMUL_SUM_MIN_NUMEL", 0)
    g = torch.randn(4, 5, 3)
    assert _matmul_sums(g)
    assert not _matmul_sums(g.transpose(0, 1))  # a copy would cost more than it saves
    assert not _matmul_sums(g.bfloat16())
    old = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # TF32 / bf16 products: not exact enough
        assert not _matmul_sums(g)
        torch.testing.assert_close(sum_positions(g, 0), g.sum(1))
    finally:
        torch.set_float32_matmul_precision(old)


class _Stack(nn.Module):
    """Linear, attention, LayerNorm and a convolution in one model, so that the product path
    runs in every sampler that uses it (sequence-first too)."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.lin = nn.Linear(4, 6)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=batch_first)
        self.norm = nn.LayerNorm(6)
        self.conv = nn.Conv1d(6, 6, 1)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        h = h + self.attn(h, h, h)[0]
        h = self.norm(h)
        h = h if self.batch_first else h.transpose(0, 1)  # (batch, positions, channels)
        return self.conv(h.transpose(1, 2))


@pytest.mark.parametrize("batch_first", [True, False])
def test_product_path_matches_the_oracle(batch_first, monkeypatch):
    monkeypatch.setattr(registry, "MATMUL_SUM_MIN_NUMEL", 0)
    model = _Stack(batch_first)
    dpfit.make_bias_trainable(model)
    model = model.double()
    b, t = 3, 6
    x = torch.randn(b, t, 4) if batch_first else torch.randn(t, b, 4)
    x = x.double()

    def loss(inp):
        return model(inp).sin().sum()

    def example(i):
        return loss(x[i : i + 1] if batch_first else x[:, i : i + 1])

    want = oracle_per_example(model, example, b)
    engine = make_engine(model, batch_first=batch_first)
    assert_matches_oracle(engine_per_example(engine, lambda: loss(x)), want)
    engine.detach()


@pytest.mark.parametrize(
    ("make", "reduce"),
    [
        (lambda: torch.randn(8, 16, 64, 64), lambda g: sum_to_channel(g, 1)),  # conv, GroupNorm
        (
            lambda: torch.randn(8, 16, 64, 64).to(memory_format=torch.channels_last),
            lambda g: sum_to_channel(g, 1),
        ),
        (lambda: torch.randn(8, 512, 256), lambda g: sum_positions(g, 0)),  # batch-first tokens
        (lambda: torch.randn(512, 8, 256), lambda g: sum_positions(g, 1)),  # sequence-first
        (lambda: torch.randn(8, 256, 512).transpose(1, 2), lambda g: sum_positions(g, 0)),
        (lambda: torch.randn(8, 512, 256, dtype=torch.float64), lambda g: sum_positions(g, 0)),
        (lambda: torch.randn(8, 128, 16, 64), lambda g: sum_positions(g, 0, 2)),  # LayerNorm
    ],
    ids=["nchw", "channels-last", "btc", "tbc", "btc-strided", "float64", "two-kept-axes"],
)
def test_per_example_sums_copy_no_gradient(make, reduce, path):
    """The sums read the output gradient where it lies: no float64, contiguous or reshaped
    copy of it, which would add a gradient-sized tensor to every bias layer's backward."""
    g = make()
    reduce(g)  # kernels' one-time set-up outside the measurement
    assert tensor_peak(lambda: reduce(g)) < g.numel() * g.element_size() // 16

"""The logical batch's clipped sum: each example bounded by R, physical batches added."""

from __future__ import annotations

import torch
from torch import nn

from dpfit.clipped_sum import ClippedSum, arrange
from dpfit.clipping import get_clipping
from dpfit.flat import FlatLayout


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))]


def _expected(per_ex: list[torch.Tensor], r: float) -> torch.Tensor:
    rows = torch.cat([g.reshape(g.shape[0], -1) for g in per_ex], 1).double()
    factors = (r / rows.norm(dim=1)).clamp(max=1.0)
    return (factors[:, None] * rows).sum(0)


def test_each_example_is_clipped_on_its_norm_over_all_parameters():
    torch.manual_seed(0)
    params = _params()
    per_ex = [torch.randn(5, 3) * 4, torch.randn(5, 2, 2) * 4]
    clipped = ClippedSum(FlatLayout(params))
    batch = arrange(dict(zip(params, per_ex, strict=True)), params, 5)
    clipped.clip_into(batch, get_clipping("flat"), 1.0, scale=1.0)
    total = clipped.take()
    assert torch.allclose(total.double(), _expected(per_ex, 1.0), rtol=1e-5, atol=1e-6)
    assert not clipped.started and torch.equal(clipped.take(), torch.zeros(7))


def test_physical_batches_add_up_and_single_parameters_land_in_their_span():
    torch.manual_seed(1)
    params = _params()
    first = [torch.randn(4, 3), torch.randn(4, 2, 2)]
    second = [torch.randn(2, 3), torch.randn(2, 2, 2)]
    clipped = ClippedSum(FlatLayout(params))
    for per_ex in (first, second):
        batch = arrange(dict(zip(params, per_ex, strict=True)), params, per_ex[0].shape[0])
        clipped.clip_into(batch, get_clipping("flat"), 0.5, scale=1.0)
    clipped.add(params[1], torch.ones(2, 2))  # a contribution of one parameter only
    want = _expected(first, 0.5) + _expected(second, 0.5)
    want[3:] += 1
    assert torch.allclose(clipped.take().double(), want, rtol=1e-5, atol=1e-6)


def test_float64_parameters_are_clipped_and_summed_in_float64():
    """A float64 model's sum is not rounded to float32 on the way: a coordinate that cancels
    to near zero keeps float64's relative accuracy (float32 rounding misses it by ~1e-5)."""
    torch.manual_seed(2)
    params = [p.double() for p in _params()]
    params = [nn.Parameter(p) for p in params]
    big = torch.randn(6, 3, dtype=torch.float64)
    big[:, 0] = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0 + 1e-9], dtype=torch.float64)
    per_ex = [big, torch.randn(6, 2, 2, dtype=torch.float64)]
    layout = FlatLayout(params)
    assert layout.dtype == torch.float64 and FlatLayout(_params()).dtype == torch.float32
    clipped = ClippedSum(layout)
    batch = arrange(dict(zip(params, per_ex, strict=True)), params, 6, layout.dtype)
    clipped.clip_into(batch, get_clipping("flat"), 10.0, scale=1.0)  # no clip: a plain sum
    total = clipped.take()
    assert total.dtype == torch.float64
    torch.testing.assert_close(total, _expected(per_ex, 10.0), rtol=1e-9, atol=1e-15)

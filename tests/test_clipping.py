"""Clip factors, with the formulas written out here rather than taken from the code under test.

Flat (Abadi et al.): c = min(1, R / ||g||). Automatic (Bu et al.): c = R / (||g|| + gamma) with
gamma = 0.01. Either way every example's clipped contribution has norm at most R, which is all
the privacy analysis assumes; the engine-level test measures that on what the engine sums.
"""

from __future__ import annotations

import pytest
import torch
from oracle import Capture
from torch import nn

import dpfit
from dpfit.clipping import clipping_names, get_clipping

GAMMA = 0.01  # Bu et al.'s stability constant, as documented


def expected_factor(kind: str, norms: torch.Tensor, R: float) -> torch.Tensor:
    if kind == "flat":
        return torch.clamp(R / norms, max=1.0)
    return R / (norms + GAMMA)


NORMS = torch.tensor([1e-4, 0.3, 0.999, 1.0, 1.5, 7.0, 1e4], dtype=torch.float64)


@pytest.mark.parametrize("kind", ["flat", "automatic"])
@pytest.mark.parametrize("R", [0.1, 1.0, 5.0])
def test_factors_follow_the_published_formulas(kind, R):
    got = get_clipping(kind)(NORMS, R)
    torch.testing.assert_close(got, expected_factor(kind, NORMS, R), rtol=1e-12, atol=0)
    assert (got * NORMS <= R * (1 + 1e-12)).all()


def test_registry_names():
    assert set(clipping_names()) >= {"flat", "automatic"}
    with pytest.raises(ValueError, match="clipping must be one of"):
        get_clipping("nope")


@pytest.mark.parametrize("kind", ["flat", "automatic"])
def test_engine_contribution_of_each_example_is_clipped_to_R(kind):
    """One example per noiseless step: the released update times B is that example's clipped
    gradient. Its norm must be c * ||g|| with c from the formula, and at most R."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Tanh(), nn.Linear(7, 3))
        dpfit.make_bias_trainable(m)
        return m

    model, twin = make(), make()  # twin: the raw gradient, without any engine
    R, B = 0.5, 4
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=B, sample_size=100, noise_multiplier=0.0, max_grad_norm=R,
        clipping=kind, sampling="user-poisson", loss_reduction="sum",
    )  # fmt: skip
    params = engine.parameters()
    opt = Capture(params)  # records the released (noised, here noiseless) update
    for scale in (0.01, 0.3, 1.0, 30.0, 1000.0):  # below and above the clip norm
        x = torch.randn(1, 5)
        twin.zero_grad()
        (twin(x).sum() * scale).backward()
        raw = torch.cat([p.grad.flatten() for p in twin.parameters() if p.requires_grad])
        (model(x).sum() * scale).backward()
        assert engine.step(opt, batch_size=1)
        released = torch.cat([opt.grads[p].flatten() for p in params])
        raw, released = raw.double(), released.double()
        contribution = released * B
        c = expected_factor(kind, raw.norm(), R)
        torch.testing.assert_close(contribution, c * raw, rtol=1e-5, atol=1e-9)
        assert contribution.norm() <= R * (1 + 1e-6)

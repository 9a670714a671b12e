"""The microbatch-of-one oracle: run each example alone and take its gradient."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

import dpfit


def oracle_per_example(
    model: nn.Module, loss_of: Callable[[int], torch.Tensor], n: int
) -> dict[str, torch.Tensor]:
    """Per-example gradients of every trainable parameter; loss_of(i) is example i's loss."""
    grads: dict[str, list[torch.Tensor]] = {}
    for i in range(n):
        model.zero_grad(set_to_none=True)
        loss_of(i).backward()
        for name, p in model.named_parameters():
            if p.requires_grad:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                grads.setdefault(name, []).append(g.detach().clone())
    model.zero_grad(set_to_none=True)
    return {k: torch.stack(v) for k, v in grads.items()}


def engine_per_example(
    engine: dpfit.PrivacyEngine, batch_loss: Callable[[], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Per-example gradients as the engine sees them for one batch (loss_reduction='sum')."""
    engine._per_example.clear()
    engine.model.zero_grad(set_to_none=True)
    batch_loss().backward()
    per = engine._collect()
    names = {p: n for n, p in engine.model.named_parameters()}
    out = {names[p]: g for p, g in per.items()}
    engine.model.zero_grad(set_to_none=True)
    return out


def assert_matches_oracle(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float = 1e-5
) -> None:
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name, w in want.items():
        g = got[name].to(w.dtype)
        assert g.shape == w.shape, (name, g.shape, w.shape)
        scale = w.abs().max().clamp_min(1e-12)
        err = (g - w).abs().max() / scale
        assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.0e}"


def assert_close_to_oracle(got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-5) -> None:
    """One flat gradient against the oracle's, to `rtol` of its largest entry."""
    assert_matches_oracle({"gradient": got}, {"gradient": want}, rtol)


def make_engine(model: nn.Module, **kw) -> dpfit.PrivacyEngine:
    args = dict(
        expected_batch_size=1,
        sample_size=1000,
        noise_multiplier=0.0,
        max_grad_norm=1.0,
        sampling="user-poisson",
        loss_reduction="sum",
    )
    args.update(kw)
    return dpfit.PrivacyEngine(model, **args)


class Capture(torch.optim.Optimizer):
    """An optimizer that only records the gradients it is asked to apply (the noised ones)."""

    def __init__(self, params):
        super().__init__(list(params), {})
        self.grads = {}

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    self.grads[p] = p.grad.detach().clone()

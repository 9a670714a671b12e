"""Deliberately broken mechanisms, injected into the REAL engine through its seams.

Each is a context manager that patches one seam and restores it on exit:
dpfit.engine.gaussian_noise, dpfit.engine.get_clipping, PrivacyEngine._collect (per-example
gradients handed to clipping), dpfit.sampling.PoissonBatchSampler.draw. Used by the audit tests
and by benchmarks/audit.py; never by the library.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch
from torch import nn

import dpfit.engine
import dpfit.sampling


@contextmanager
def noise_scaled(factor: float) -> Iterator[None]:
    """Noise std multiplied by `factor` (0.1: ten times too small)."""
    real = dpfit.engine.gaussian_noise

    def broken(shape, std, generator, secure, like):
        return real(shape, std * factor, generator, secure, like)

    with mock.patch.object(dpfit.engine, "gaussian_noise", broken):
        yield


@contextmanager
def noise_on_mean(expected_batch_size: int) -> Iterator[None]:
    """Noise calibrated for the mean: std sigma R / B added to the sum (then divided by B)."""
    with noise_scaled(1.0 / expected_batch_size):
        yield


@contextmanager
def clipping_off() -> Iterator[None]:
    """Every clip factor 1: per-example gradients summed raw."""
    with mock.patch.object(
        dpfit.engine, "get_clipping", lambda name: lambda norms, r: torch.ones_like(norms)
    ):
        yield


@contextmanager
def clipping_off_for(family: type[nn.Module]) -> Iterator[None]:
    """Biases of one layer family skip the per-example norm and the clip (summed raw)."""
    real = dpfit.engine.PrivacyEngine._collect

    def collect(self):
        per_ex = real(self)
        fam = {m.bias for m in self.model.modules() if isinstance(m, family)}
        for p in [p for p in per_ex if p in fam]:
            g = per_ex.pop(p)
            n = g.shape[0]
            scale = float(n) if self.config.loss_reduction == "mean" else 1.0
            self._add_to_sum(p, (g.reshape(n, -1).float() * scale).sum(0))
            p.grad = None
        return per_ex

    with mock.patch.object(dpfit.engine.PrivacyEngine, "_collect", collect):
        yield


@contextmanager
def shuffled_batches() -> Iterator[None]:
    """Fixed-size batches from a shuffle per epoch (each example once per pass) while the
    accountant is told Poisson sampling at rate q."""
    state: dict[int, list[int]] = {}

    def draw(self):
        size = max(1, round(self.sample_rate * self.num_samples))
        left = state.get(id(self), [])
        if len(left) < size:
            left = torch.randperm(self.num_samples, generator=self.generator).tolist()
        state[id(self)] = left[size:]
        return sorted(left[:size])

    with mock.patch.object(dpfit.sampling.PoissonBatchSampler, "draw", draw):
        yield

"""The Gaussian noise of the mechanism: N(0, std^2) per element, from a torch generator or,
with `secure`, from os.urandom (dpfit.rng).

The engine draws it once per logical step on the summed clipped gradients, calling it through
its own module name (`dpfit.engine.gaussian_noise`, the seam the audit tests patch).
"""

from __future__ import annotations

import math

import torch

from dpfit.rng import os_uniform


def gaussian_noise(
    shape: torch.Size,
    std: float,
    generator: torch.Generator | None,
    secure: bool,
    like: torch.Tensor,
) -> torch.Tensor:
    """N(0, std^2) noise; with `secure`, from os.urandom through Box-Muller in float64
    (`generator` is then unused and may be None)."""
    if std == 0:
        return torch.zeros(shape, dtype=like.dtype, device=like.device)
    if not secure:
        if generator is None:
            raise ValueError("gaussian_noise needs a generator unless secure=True")
        z = torch.randn(shape, generator=generator, dtype=torch.float32).mul_(std)
        return z.to(device=like.device, dtype=like.dtype)  # itself when they already match
    n = math.prod(shape)
    m = n + (n % 2)
    u = os_uniform(m)
    u1, u2 = u[: m // 2], u[m // 2 :]
    r = torch.sqrt(-2.0 * torch.log(u1))
    z = torch.cat([r * torch.cos(2 * math.pi * u2), r * torch.sin(2 * math.pi * u2)])[:n]
    return (z.reshape(shape) * std).to(device=like.device, dtype=like.dtype)

"""Where privacy-critical randomness comes from.

Noise and Poisson sampling decide what an adversary can learn, so by default their generators
are seeded from the operating system's cryptographic source (os.urandom), never from a seed a
user picked for the public parts of a run. Three levels, weakest first:

* an explicit ``insecure_seed``: reproducible, and not private against anyone who knows it;
* the default: torch generators seeded from os.urandom. Their state is secret; it lives only
  in the engine and in checkpoints (which must therefore be kept secret);
* ``secure_rng=True``: every uniform draw comes from os.urandom, so there is no generator
  state to steal, at some cost in speed.
"""

from __future__ import annotations

import hashlib
import os

import torch

_MASK63 = (1 << 63) - 1


def secure_seed() -> int:
    """A 63-bit seed from os.urandom."""
    return int.from_bytes(os.urandom(8), "little") & _MASK63


def derive_seed(seed: int, stream: str) -> int:
    """A seed for one named stream (noise, sampling) from a user's seed: distinct streams
    from one seed, so the noise is not the sampler's draws reused."""
    digest = hashlib.sha256(f"dpfit:{stream}:{int(seed)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & _MASK63


def os_uniform(n: int) -> torch.Tensor:
    """n uniforms in (0, 1), float64, 53 random bits each, straight from os.urandom."""
    raw = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64) if n else None
    if raw is None:
        return torch.empty(0, dtype=torch.float64)
    return (((raw >> 11) & ((1 << 53) - 1)).to(torch.float64) + 0.5) * 2.0**-53


def make_generator(seed: int | None, stream: str) -> torch.Generator:
    """A CPU generator for `stream`: from os.urandom when seed is None, else derived from it."""
    value = secure_seed() if seed is None else derive_seed(seed, stream)
    return torch.Generator().manual_seed(value)

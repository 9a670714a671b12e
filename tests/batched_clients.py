"""Clients and start points shared by the batched engine's exactness tests (one per layer
family): uneven random clients of tiny-vocabulary texts, and a start away from the model's
initial values so every trainable gets a gradient at the first step."""

from __future__ import annotations

import numpy as np

from dpfit.data.bundled import TextExample
from dpfit.models import TINY_WORDS


def random_clients(sizes: list[int], seed: int = 0) -> list[list[TextExample]]:
    rng = np.random.default_rng(seed)
    out = []
    for c, n in enumerate(sizes):
        rows = []
        for i in range(n):
            words = rng.choice(TINY_WORDS, size=int(rng.integers(1, 10)))
            rows.append(TextExample(f"{c} {i} " + " ".join(words), int(rng.random() < 0.5)))
        out.append(rows)
    return out


def perturbed_start(lm, seed: int = 1) -> list[np.ndarray]:
    """The trainables' initial values plus N(0, 0.3^2): a non-zero head and LoRA B."""
    rng = np.random.default_rng(seed)
    return [a + 0.3 * rng.standard_normal(a.shape) for a in lm.initial]

"""Automatic clipping (Bu et al.) for client updates: every update normalised, no C to tune.

Bu, Wang, Zha, Karypis, "Automatic Clipping: Differentially Private Deep Learning Made Easier
and Stronger", NeurIPS 2023, Section 4: AUTO-S replaces the per-sample clip factor
min(1, R/||g_i||) by R / (||g_i|| + gamma), gamma a small stability constant (0.01 in their
experiments). Here g_i is a client's model update Delta_i, so each contribution is
Delta_i * R / (||Delta_i|| + gamma), of norm R ||Delta_i|| / (||Delta_i|| + gamma) < R:
the sensitivity is R and the noise on the sum is z R, as for a fixed clip norm R.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpfit.federated.clipping.base import (
    ClipRule,
    RoundObservation,
    global_norm,
    register_clip_rule,
    scale_update,
)


def automatic_scale(norm: float, bound: float, gamma: float) -> float:
    """AUTO-S factor R / (||Delta|| + gamma)."""
    return bound / (norm + gamma)


@register_clip_rule("automatic")
@dataclass
class AutomaticClip(ClipRule):
    """Bu et al. 2023 AUTO-S on client updates; R = ``initial_clip`` never moves."""

    def clip(self, arrays: Sequence[np.ndarray]) -> tuple[list[np.ndarray], float]:
        norm = global_norm(arrays)
        factor = automatic_scale(norm, self.clip_norm, self.config.auto_gamma)
        return scale_update(arrays, factor), norm

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        return self.clip_norm

"""Quantile-adaptive clipping: C follows a target quantile of the update norms, privately.

Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with Adaptive
Clipping", NeurIPS 2021: Algorithm 1 and Theorem 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpfit.federated.clipping.base import (
    ClipConfig,
    ClipRule,
    ClipRuleError,
    RoundObservation,
    register_clip_rule,
    split_multiplier,
)


def effective_update_multiplier(z: float, count_noise_std: float) -> float:
    """Andrew et al. Theorem 1: z_eff = (z^-2 - (2 sigma_b)^-2)^-1/2 for the update sum.

    The count release sums ``b_i - 1/2`` (sensitivity 1/2), so its multiplier is 2 sigma_b.
    """
    if z == 0:
        return 0.0
    if 2.0 * count_noise_std <= z:
        raise ClipRuleError(
            f"clipped-count noise sigma_b={count_noise_std:.4g} is too small for z={z:.4g}: "
            f"need 2*sigma_b > z; raise count_noise_std or use count_budget_share"
        )
    return float((z**-2 - (2.0 * count_noise_std) ** -2) ** -0.5)


def noised_unclipped_fraction(
    norms: Sequence[float],
    clip_norm: float,
    expected_clients: float,
    count_noise_std: float,
    rng: np.random.Generator,
) -> float:
    """Private fraction of updates with norm <= C (UNclipped), Andrew et al. Algorithm 1.

    Sums ``b_i - 1/2`` so one client moves the sum by at most 1/2, noises it, and divides by
    the expected number of clients (public) rather than by how many answered.
    """
    centred = sum((1.0 if n <= clip_norm else 0.0) - 0.5 for n in norms)
    noise = rng.normal(0.0, count_noise_std) if count_noise_std > 0 else 0.0
    return (centred + noise) / expected_clients + 0.5


def quantile_step(clip_norm: float, unclipped_fraction: float, target: float, lr: float) -> float:
    """Geometric update C <- C * exp(-lr * (b - target)): too many unclipped means C too big."""
    return float(clip_norm * math.exp(-lr * (unclipped_fraction - target)))


@register_clip_rule("adaptive-quantile")
@dataclass
class QuantileClip(ClipRule):
    """Andrew et al. 2021: C tracks the target quantile of update norms, privately."""

    @staticmethod
    def count_noise_std(config: ClipConfig) -> float:
        if config.noise_multiplier == 0:
            return 0.0
        if config.count_noise_std is not None:
            return config.count_noise_std
        _, aux = split_multiplier(config.noise_multiplier, config.count_budget_share)
        return aux / 2.0

    @classmethod
    def round_multipliers(cls, config: ClipConfig) -> tuple[float, ...]:
        if config.noise_multiplier == 0:
            return (0.0, 0.0)
        sigma_b = cls.count_noise_std(config)
        return (effective_update_multiplier(config.noise_multiplier, sigma_b), 2.0 * sigma_b)

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        frac = noised_unclipped_fraction(
            obs.update_norms,
            self.clip_norm,
            self.config.expected_clients,
            self.count_noise_std(self.config),
            rng,
        )
        self.clip_norm = quantile_step(
            self.clip_norm, frac, self.config.target_quantile, self.config.quantile_lr
        )
        return self.clip_norm

"""DP-CLAC: DP-LAC's loss ratio without public data, on privately aggregated client losses."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from dpfit.federated.clipping.base import (
    ClipConfig,
    RoundObservation,
    register_clip_rule,
    split_multiplier,
)
from dpfit.federated.clipping.lac import LossRatioClip


def private_mean_loss(
    losses: Sequence[float],
    loss_bound: float,
    expected_clients: float,
    noise_std: float,
    rng: np.random.Generator,
) -> float:
    """DP-CLAC: mean of losses clipped to [0, L_max], Gaussian noise with std z_loss * L_max.

    Divides by the expected number of clients; the result is clamped to [0, L_max] (post-
    processing) so ratios stay meaningful.
    """
    total = sum(min(max(x, 0.0), loss_bound) for x in losses if math.isfinite(x))
    if noise_std > 0:
        total += rng.normal(0.0, noise_std)
    return float(min(max(total / expected_clients, 0.0), loss_bound))


@register_clip_rule("clac")
@dataclass
class ClacClip(LossRatioClip):
    """DP-CLAC: no public data; the loss ratio comes from privately aggregated client losses.

    Clients report the loss of the model they received, so the private loss of round t is
    v_{t-1}: the rule lags one round behind DP-LAC.
    """

    needs_client_loss: ClassVar[bool] = True

    @classmethod
    def round_multipliers(cls, config: ClipConfig) -> tuple[float, ...]:
        return split_multiplier(config.noise_multiplier, config.loss_budget_share)

    def loss_noise_std(self) -> float:
        return self.round_multipliers(self.config)[1] * self.config.loss_bound

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        loss = private_mean_loss(
            obs.client_losses,
            self.config.loss_bound,
            self.config.expected_clients,
            self.loss_noise_std(),
            rng,
        )
        return self._apply(loss)

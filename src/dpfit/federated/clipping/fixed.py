"""DP-FedAvg's fixed clip norm."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpfit.federated.clipping.base import ClipRule, RoundObservation, register_clip_rule


@register_clip_rule("fixed")
@dataclass
class FixedClip(ClipRule):
    """DP-FedAvg (McMahan et al. 2018): C never moves."""

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        return self.clip_norm

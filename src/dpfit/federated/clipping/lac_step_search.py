"""DP-LAC with a public step search (``lac-step``): C from a two-sided vote, then each round's
step scaled on the public validation split.

The protocol (``benchmarks/results/federated_misspec.md``) showed what moving C after the vote
costs: ``lac-2s`` starts at the C_0 its vote picks (1, at eps 2 and 8 alike), and its band and
brake then lose about 3 points at eps 2 against a fixed clip at that same C_0, while the best
fixed clip there (0.25) is a quarter of it. When most updates are clipped, clipping at C and
scaling the noised average by eta is clipping at eta C: the same signal-to-noise ratio, a
smaller step. So this rule keeps C at the vote's C_0 and lets the server pick the step:

1. **Vote**, as ``lac-2s``: one-hot votes over {0.1, 0.2, 0.5, 1, 2, 5, 10} x C_init, each
   client's trial noised with the run's accumulated noise (z C sqrt(T) / m), the counts under
   one Gaussian (sensitivity 1) from ``vote_budget_share`` of the target epsilon.
2. **Step search**: after each round's noised sum is released, the server tries the update
   scaled by each of :data:`STEPS` and keeps the one with the lowest loss on its public
   validation split. Post-processing of a released sum on public data: no privacy cost, and
   no new hyperparameter a user sets (the scales are shrink-only, so no round moves further
   than the calibrated update would).

Privacy: the vote once, then the update sum (the whole per-round budget: no count release).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from dpfit.federated.clipping.base import ClipRule, RoundObservation, register_clip_rule
from dpfit.federated.clipping.lac import VotedStart
from dpfit.federated.clipping.lac_two_sided import FACTORS

NAME = "lac-step"
STEPS = (0.25, 0.5, 1.0)  # the server's step scales, tried on the public validation split


@register_clip_rule(NAME)
@dataclass
class LacStepClip(VotedStart, ClipRule):
    """A two-sided vote for C, then the server's step chosen on public validation data."""

    needs_validation: ClassVar[bool] = True
    server_steps: ClassVar[tuple[float, ...]] = STEPS

    def candidates(self) -> list[float]:
        return [f * self.config.initial_clip for f in FACTORS]

    def vote_trial_multiplier(self) -> float:
        """The trial noise's multiplier: the run's accumulated noise, z sqrt(T)."""
        return self.update_multiplier * math.sqrt(self.config.total_rounds)

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        return self.clip_norm  # C stays at the vote's C_0; the step search moves the step

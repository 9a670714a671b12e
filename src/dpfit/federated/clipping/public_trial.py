"""``public-trial``: C chosen by the server on its public data, at no privacy cost.

Every client vote (DP-LAC's, lac-2s's) scores a client's OWN update on its own examples:
there one client's update carries its whole signal, while the released average of m clients
carries only what they agree on, so the vote overrates a large clip. In the misspecification
protocol lac-2s's vote picked C_0 = 1 at eps 2 and at eps 8 alike, where the best fixed clip
was 0.25 and 1.

The server holds a public validation set and knows z, m and T. Before round 1 it runs the
trial itself (``dpfit.federated.public_trial``): pseudo-clients cut from one half of the
public set train as clients do, and for each candidate C their clipped updates are averaged
and the noise the run will carry, std z C sqrt(T) / m, is added; the other half scores the
result (the loss, averaged over a few noise draws). C is the candidate with the lowest loss,
then kept for the run. The candidates span 0.01x to 100x C_init (1-2-5 steps): scoring one
costs a few evaluations of the public half, so a wide grid is cheap and a C_init wrong by
100x either way still has the chosen C among them.

Privacy: the trial reads only public data, so it releases nothing about the clients; the
rounds are DP-FedAvg with a fixed C, accounted exactly as ``fixed`` (the whole per-round
budget goes to the update). The trial's noise draws come from the server's noise generator.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from dpfit.federated.clipping.base import (
    ClipRule,
    ClipRuleError,
    RoundObservation,
    register_clip_rule,
)

logger = logging.getLogger(__name__)

NAME = "public-trial"
FACTORS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


@register_clip_rule(NAME)
@dataclass
class PublicTrialClip(ClipRule):
    """C from the server's trial on public data (no privacy cost), then fixed."""

    needs_validation: ClassVar[bool] = True
    needs_public_trial: ClassVar[bool] = True

    def candidates(self) -> list[float]:
        return [f * self.config.initial_clip for f in FACTORS]

    def trial_noise_per_clip(self) -> float:
        """Std of the trial's noise on the average per unit of C: the run's accumulated
        noise, z_u sqrt(T) / m (all public)."""
        cfg = self.config
        return self.update_multiplier * math.sqrt(cfg.total_rounds) / cfg.expected_clients

    def initialise_from_trial(self, losses: Sequence[float]) -> float:
        """C = the candidate with the lowest finite trial loss (the smaller one on a tie)."""
        cands = self.candidates()
        if len(losses) != len(cands):
            raise ClipRuleError(f"{len(losses)} trial losses for {len(cands)} candidates")
        finite = [(x, c) for x, c in zip(losses, cands, strict=True) if math.isfinite(x)]
        if not finite:
            raise ClipRuleError("every public trial loss is non-finite: C cannot be chosen")
        self.clip_norm = float(min(finite)[1])
        logger.info("public trial: losses %s -> C = %.4g", np.round(losses, 4), self.clip_norm)
        return self.clip_norm

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        return self.clip_norm

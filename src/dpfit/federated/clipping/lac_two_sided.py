"""Two-sided DP-LAC (``lac-2s``): a C_init that is wrong by up to 10x either way needs no tuning.

DP-LAC (``lac.py``, kept as published) rescues a clip that is too large and cannot help one
that is too small: its vote's candidates are {0.25, 0.5, 1} x C_init, its decay only shrinks
(and loses C on every upward wobble of the validation loss), and its vote's objective, the
client's loss after ONE simulated noisy round, barely sees the privacy level. This rule:

1. **Vote** over a 1-2-5 grid spanning both sides of C_init, {0.1, 0.2, 0.5, 1, 2, 5, 10} x
   C_init, with DP-LAC's mechanism (one-hot votes, Gaussian sigma_h on the counts, once).
   Each client's trial adds the noise the model will CARRY at the end of the run, the sum of
   T rounds' noise on the average: std z_u C sqrt(T) / m (z_u, T and m public), not one
   round's z_u C / m, so a large C costs what it will cost.
2. **Band** on the private fraction b of UNclipped updates (Andrew et al.'s count release,
   ``quantile.py``, its own share of each round's budget): when b is below 1/2 (most updates
   clipped: C too small) C grows, by up to 2x a round; when b is above 0.95 (C above nearly
   every update: its noise buys no signal) C shrinks, by up to 2x. Inside the band C stays.
   A move is made only when b is outside the band by more than one std of its noise
   (sigma_b / m, public), so with few clients a round the band does nothing on noise alone.
3. **Brake** on the public validation loss v (free: post-processing on public data): the loss
   is smoothed over the last ``SMOOTH`` rounds; when the smoothed loss rises above its best by
   more than ``RISE`` (relative), C halves, and no second brake follows within ``SMOOTH``
   rounds (the smoothed loss must first see the new C). A wobble of the loss within RISE never
   shrinks C; growth is held while the loss is above its best by more than RISE (a diverging
   model's large updates must not pull C up).

Privacy: the vote is one Gaussian (sensitivity 1) before round 1, sigma_h from
``vote_budget_share`` of the target epsilon as for DP-LAC; each round releases the update sum
(z_u) and the centred clipped count (multiplier 2 sigma_b, ``count_budget_share`` of 1/z^2),
which compose to the calibrated z (Theorem 1 of Andrew et al.). Both are in the ledger through
``one_off_multipliers`` and ``round_multipliers``.

The constants are set by the arguments above, not tuned on any test split.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from dpfit.federated.clipping.base import (
    ClipConfig,
    ClipRule,
    RoundObservation,
    register_clip_rule,
)
from dpfit.federated.clipping.lac import VotedStart
from dpfit.federated.clipping.quantile import QuantileClip, noised_unclipped_fraction

logger = logging.getLogger(__name__)

NAME = "lac-2s"
FACTORS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)  # the vote's candidates, x C_init
BAND = (0.5, 0.95)  # unclipped fraction below: grow; above: shrink
MAX_STEP = 2.0  # at most this factor per round, reached at b = 0 (grow) or b = 1 (shrink)
SMOOTH = 3  # rounds in the smoothed validation loss, and the brake's cooldown
RISE = 0.05  # relative rise of the smoothed loss over its best that triggers the brake
BRAKE = 0.5  # C multiplied by this on a brake


def band_step(
    clip_norm: float,
    unclipped: float,
    noise_std: float,
    band: tuple[float, float] = BAND,
    max_step: float = MAX_STEP,
    allow_growth: bool = True,
) -> float:
    """C moved by how far the noised unclipped fraction is outside the band (0 inside).

    Only when it is outside by more than one std of its noise: the move is then
    ``max_step ** (distance / room)``, room the distance from the band's edge to 0 or 1.
    """
    low, high = band
    if unclipped + noise_std < low and allow_growth:
        return float(clip_norm * max_step ** (min(low - unclipped, low) / low))
    if unclipped - noise_std > high:
        return float(clip_norm * max_step ** (-min(unclipped - high, 1 - high) / (1 - high)))
    return clip_norm


def smoothed(losses: Sequence[float], window: int = SMOOTH) -> float:
    """Mean of the last ``window`` losses (fewer at the start)."""
    tail = list(losses)[-window:]
    return float(sum(tail) / len(tail))


@register_clip_rule(NAME)
@dataclass
class TwoSidedLacClip(VotedStart, ClipRule):
    """Two-sided DP-LAC: a vote over 0.1x..10x C_init, a clipped-fraction band, a loss brake."""

    needs_validation: ClassVar[bool] = True
    losses: list[float] = field(default_factory=list)
    best: float = math.inf
    cooldown: int = 0

    # -- privacy: the vote once, then the update and the clipped count every round ------

    @classmethod
    def round_multipliers(cls, config: ClipConfig) -> tuple[float, ...]:
        return QuantileClip.round_multipliers(config)

    @staticmethod
    def count_noise_std(config: ClipConfig) -> float:
        """sigma_b, the std of the noise on the centred count (sensitivity 1/2)."""
        return QuantileClip.count_noise_std(config)

    def candidates(self) -> list[float]:
        return [f * self.config.initial_clip for f in FACTORS]

    def vote_trial_multiplier(self) -> float:
        """The trial noise's multiplier: the run's accumulated noise, z_u sqrt(T)."""
        return self.update_multiplier * math.sqrt(self.config.total_rounds)

    def fraction_std(self) -> float:
        """Std of the noised unclipped fraction (public): sigma_b / m."""
        return self.count_noise_std(self.config) / self.config.expected_clients

    # -- one round ----------------------------------------------------------------------

    def _healthy(self) -> bool:
        return not self.losses or smoothed(self.losses) <= self.best * (1 + RISE)

    def _brake(self, loss: float | None) -> None:
        if loss is None or not math.isfinite(loss):
            logger.warning("no usable validation loss; the brake is skipped this round")
            return
        self.losses.append(float(loss))
        level = smoothed(self.losses)
        self.cooldown = max(0, self.cooldown - 1)
        if level > self.best * (1 + RISE) and self.cooldown == 0 and len(self.losses) > 1:
            self.clip_norm *= BRAKE
            self.cooldown = SMOOTH
            logger.info("validation loss %.4g above best %.4g: C -> %.4g", level, self.best,
                        self.clip_norm)  # fmt: skip
        self.best = min(self.best, level)

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        frac = noised_unclipped_fraction(
            obs.update_norms,
            self.clip_norm,
            self.config.expected_clients,
            self.count_noise_std(self.config),
            rng,
        )
        before = self.clip_norm
        self._brake(obs.val_loss)
        if self.clip_norm == before:  # no brake this round: the band may move C
            self.clip_norm = band_step(
                self.clip_norm, frac, self.fraction_std(), allow_growth=self._healthy()
            )
        return self.clip_norm

    def state_dict(self) -> dict[str, Any]:
        return {
            "clip_norm": self.clip_norm,
            "losses": list(self.losses),
            "best": self.best,
            "cooldown": self.cooldown,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip_norm = float(state["clip_norm"])
        self.losses = [float(x) for x in state.get("losses", [])]
        self.best = float(state.get("best", math.inf))
        self.cooldown = int(state.get("cooldown", 0))

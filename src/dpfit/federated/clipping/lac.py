"""DP-LAC: C0 from a private vote of the clients, then C shrinks with the validation loss.

C_t = C_{t-1} * min(1, v_{t-1} / v_{t-2}), v the loss on the server's public validation
split (free: post-processing of released models on public data). The loss-ratio step is
shared with DP-CLAC (``clac.py``), which privately aggregates client losses instead.
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
    ClipRuleError,
    RoundObservation,
    register_clip_rule,
)

logger = logging.getLogger(__name__)


def lac_step(clip_norm: float, loss_prev: float, loss_prev2: float) -> float:
    """DP-LAC: C_t = C_{t-1} * min(1, v_{t-1} / v_{t-2}); never increases C.

    Non-finite or non-positive losses carry no information (a noised DP-CLAC loss can be
    clamped to 0), so C is kept rather than collapsed.
    """
    if not (math.isfinite(loss_prev) and math.isfinite(loss_prev2)):
        return clip_norm
    if loss_prev <= 0 or loss_prev2 <= 0:
        return clip_norm
    return float(clip_norm * min(1.0, loss_prev / loss_prev2))


def one_hot_vote(candidate_losses: Sequence[float]) -> list[int]:
    """A client's vote: one-hot on the candidate with the lowest (finite) local loss."""
    losses = [x if math.isfinite(x) else math.inf for x in candidate_losses]
    best = int(np.argmin(losses))
    return [1 if i == best else 0 for i in range(len(losses))]


def noised_histogram(
    votes: Sequence[Sequence[int]], num_bins: int, noise_std: float, rng: np.random.Generator
) -> np.ndarray:
    """Gaussian mechanism on the vote sums (L2 sensitivity 1: one client, one one-hot vote)."""
    counts = np.zeros(num_bins, dtype=np.float64)
    for v in votes:
        if len(v) != num_bins or sum(v) != 1 or any(x not in (0, 1) for x in v):
            raise ClipRuleError(f"a vote must be one-hot of length {num_bins}, got {list(v)}")
        counts += np.asarray(v, dtype=np.float64)
    if noise_std > 0:
        counts += rng.normal(0.0, noise_std, size=num_bins)
    return counts


@dataclass
class LossRatioClip(ClipRule):
    """Shared loss-ratio rule: C_t = C_{t-1} * min(1, v_{t-1}/v_{t-2})."""

    losses: list[float] = field(default_factory=list)

    def _apply(self, loss: float | None) -> float:
        if loss is None or not math.isfinite(loss):
            logger.warning("no usable loss this round; clip norm kept at %.4g", self.clip_norm)
            return self.clip_norm
        self.losses.append(float(loss))
        if len(self.losses) >= 2:
            self.clip_norm = lac_step(self.clip_norm, self.losses[-1], self.losses[-2])
        return self.clip_norm

    def state_dict(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm, "losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip_norm = float(state["clip_norm"])
        self.losses = [float(x) for x in state.get("losses", [])]


class VotedStart:
    """C0 from a private vote of all clients over ``vote_factors`` x C_init (DP-LAC; DP-CLAC).

    Each client votes one-hot for the candidate with the lowest local loss after a simulated
    noisy aggregate; the server adds N(0, sigma_h^2) to each count (sensitivity 1) once.
    """

    needs_votes: ClassVar[bool] = True

    @classmethod
    def one_off_multipliers(cls, config: ClipConfig) -> tuple[float, ...]:
        return (config.vote_noise_std,)

    def candidates(self) -> list[float]:
        return [f * self.config.initial_clip for f in self.config.vote_factors]

    def vote_trial_multiplier(self) -> float:
        """Multiplier of the noise in each client's trial aggregate (std z C / m): one
        round's update multiplier, the paper's objective."""
        return self.update_multiplier

    def initialise_from_votes(
        self, votes: Sequence[Sequence[int]], rng: np.random.Generator
    ) -> np.ndarray:
        """Set C0 to the candidate with the most (noised) votes; returns the noised counts."""
        cands = self.candidates()
        counts = noised_histogram(votes, len(cands), self.config.vote_noise_std, rng)
        self.clip_norm = cands[int(np.argmax(counts))]
        return counts


@register_clip_rule("lac")
@dataclass
class LacClip(VotedStart, LossRatioClip):
    """DP-LAC: C0 from a private vote, then the public validation-loss ratio (free)."""

    needs_validation: ClassVar[bool] = True

    def observe_validation(self, val_loss: float) -> float:
        """Record v for the current model (call once before round 1 and after each round)."""
        return self._apply(val_loss)

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        return self._apply(obs.val_loss)

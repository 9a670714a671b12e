"""DP-CLAC: DP-LAC without public data: a vote for C0, then privately aggregated client losses.

The paper's ratio step C_t = C_{t-1} min(1, v_{t-1}/v_{t-2}) on a NOISED loss shrinks C on
noise alone: at eps 2 the noised mean loss has std ~0.08 against round-to-round changes of
~0.005, so about half the rounds see a spurious decrease and C halves in 10 rounds. dpfit's
rule shrinks only on a decrease the noise cannot explain (anchored significant decrease):

    anchor = v_1;  if anchor - v_t > k * sqrt(2) * s:  C <- C * v_t / anchor,  anchor <- v_t

with s = z_loss L_max / m the std of one noised mean loss (public), sqrt(2) s the std of the
difference of two, and k = ``clac_significance`` (2 by default: a flat loss triggers a shrink
with probability ~2% against the anchor, and each shrink lowers the anchor to a low draw, so
later spurious shrinks get rarer still). Without noise (s = 0) it shrinks on every new
lowest loss by the ratio to the previous lowest, the paper's rule on a decreasing loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dpfit.federated.clipping.base import (
    ClipConfig,
    RoundObservation,
    register_clip_rule,
    split_multiplier,
)
from dpfit.federated.clipping.lac import LossRatioClip, VotedStart


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


def significant_decrease_step(
    clip_norm: float, anchor: float, loss: float, loss_std: float, significance: float
) -> tuple[float, float]:
    """(new C, new anchor): shrink by loss/anchor only if anchor - loss > k sqrt(2) std."""
    if not (math.isfinite(loss) and loss > 0 and anchor > 0):
        return clip_norm, anchor
    if anchor - loss > significance * math.sqrt(2.0) * loss_std:
        return float(clip_norm * loss / anchor), loss
    return clip_norm, anchor


@register_clip_rule("clac")
@dataclass
class ClacClip(VotedStart, LossRatioClip):
    """DP-CLAC: C0 from the private vote; then C shrinks on a significant decrease of the
    privately aggregated client losses (see the module docstring for the rule).

    Clients report the loss of the model they received, so the private loss of round t is
    v_{t-1}: the rule lags one round behind DP-LAC.
    """

    anchor: float | None = None
    needs_client_loss: ClassVar[bool] = True

    @classmethod
    def round_multipliers(cls, config: ClipConfig) -> tuple[float, ...]:
        return split_multiplier(config.noise_multiplier, config.loss_budget_share)

    def loss_noise_std(self) -> float:
        """Std of the noise on the SUM of clamped losses."""
        return self.round_multipliers(self.config)[1] * self.config.loss_bound

    def mean_loss_std(self) -> float:
        """Std of one noised MEAN loss (public: from the multiplier, L_max and m)."""
        return self.loss_noise_std() / self.config.expected_clients

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        loss = private_mean_loss(
            obs.client_losses,
            self.config.loss_bound,
            self.config.expected_clients,
            self.loss_noise_std(),
            rng,
        )
        self.losses.append(loss)
        if self.anchor is None:
            self.anchor = loss if loss > 0 else None
            return self.clip_norm
        self.clip_norm, self.anchor = significant_decrease_step(
            self.clip_norm,
            self.anchor,
            loss,
            self.mean_loss_std(),
            self.config.clac_significance,
        )
        return self.clip_norm

    def state_dict(self) -> dict[str, Any]:
        return dict(super().state_dict(), anchor=self.anchor)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        anchor = state.get("anchor")
        self.anchor = None if anchor is None else float(anchor)

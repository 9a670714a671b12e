"""Dynamic DP-SGD (Du et al.) for client updates: C and the noise multiplier decay on a schedule.

Du, Li, Chen, Chen, Hong, "Dynamic Differential-Privacy Preserving SGD", arXiv:2111.00173
(2021). Over T iterations the clipping threshold and the noise decay exponentially:
C_t = C_0 * rho_c^(t/T) and sigma_t = sigma_0 * rho_sigma^(t/T), t = 0, ..., T-1 (the paper
writes the noise side as a growing per-step GDP parameter mu_t = mu_0 * rho_mu^(-t/T), with
sigma_t = 1/mu_t). Here t counts server rounds, rho_c = ``clip_decay``, rho_sigma =
``noise_decay`` (0.5 and 0.5 by default: our choice, not tuned), and sigma_0 is calibrated so
the whole schedule spends the target budget. The paper accounts with the GDP central limit
theorem; dpfit records each round as its own Poisson-subsampled Gaussian with that round's
multiplier, and composes them with RDP or PLD like every other rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from dpfit.federated.clipping.base import (
    ClipConfig,
    ClipRule,
    RoundObservation,
    register_clip_rule,
)


def dynamic_clip(c0: float, decay: float, t: int, total: int) -> float:
    """C_t = C_0 * rho_c^(t/T)."""
    return float(c0 * decay ** (t / total))


def dynamic_multiplier(z0: float, decay: float, t: int, total: int) -> float:
    """sigma_t = sigma_0 * rho_sigma^(t/T)."""
    return float(z0 * decay ** (t / total))


@register_clip_rule("dynamic")
@dataclass
class DynamicClip(ClipRule):
    """Du et al. 2021: C_t and z_t decayed on a schedule fixed in advance (no data used)."""

    rounds_done: int = 0
    scheduled: ClassVar[bool] = True

    @classmethod
    def multipliers_at(cls, config: ClipConfig, t: int) -> tuple[float, ...]:
        return (
            dynamic_multiplier(config.noise_multiplier, config.noise_decay, t, config.total_rounds),
        )

    @classmethod
    def schedule(cls, config: ClipConfig, rounds: int) -> list[tuple[float, ...]]:
        return [cls.multipliers_at(config, t) for t in range(rounds)]

    def current_multipliers(self) -> tuple[float, ...]:
        return self.multipliers_at(self.config, self.rounds_done)

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        self.rounds_done += 1
        self.clip_norm = dynamic_clip(
            self.config.initial_clip,
            self.config.clip_decay,
            self.rounds_done,
            self.config.total_rounds,
        )
        return self.clip_norm

    def state_dict(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm, "rounds_done": self.rounds_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip_norm = float(state["clip_norm"])
        self.rounds_done = int(state["rounds_done"])

"""DP-LAC without its vote: C0 given, then the same validation-loss shrink as DP-LAC.

A comparison arm (benchmarks/federated_lac.py ``--lac-c0``), not a rule for users: it separates
what DP-LAC's vote costs (its share of the budget, about a tenth, taken from the rounds) from
what its per-round shrink does. Nothing is released before round 1, so calibration gives the
whole target epsilon to the rounds. Registered as ``lac-c0`` when this module is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from dpfit.federated.clipping.base import ClipConfig, RoundObservation, register_clip_rule
from dpfit.federated.clipping.lac import LossRatioClip

if TYPE_CHECKING:
    from dpfit.federated.strategy import DPFedAvgServer

NAME = "lac-c0"


@register_clip_rule(NAME)
@dataclass
class LacFromC0(LossRatioClip):
    """C_0 = C_init (no vote), then C_t = C_{t-1} * min(1, v_{t-1} / v_{t-2}) as DP-LAC."""

    needs_validation: ClassVar[bool] = True

    @classmethod
    def one_off_multipliers(cls, config: ClipConfig) -> tuple[float, ...]:
        return ()  # no vote: nothing is released outside the rounds

    def observe_validation(self, val_loss: float) -> float:
        return self._apply(val_loss)

    def observe(self, obs: RoundObservation, rng: np.random.Generator) -> float:
        return self._apply(obs.val_loss)


def start_without_vote(server: DPFedAvgServer) -> None:
    """Initialise a ``lac-c0`` server as DP-LAC's is, less the vote: v_0, the start model's
    public validation loss, is recorded so that C first shrinks after round 1 as in DP-LAC."""
    if not isinstance(server.rule, LacFromC0):
        raise TypeError(f"start_without_vote needs a {NAME} server, got {server.config.method}")
    server.initialise(None)  # no vote: the ledger stays empty before round 1
    v0, _ = server.evaluate()
    server.rule.observe_validation(v0)

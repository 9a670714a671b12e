"""Client-level privacy accounting for federated rounds, as dp-accounting events.

What happened is recorded as data (a list of releases), and epsilon is computed from the
composed ``DpEvent``: one-off Gaussian releases (the DP-LAC vote histogram) plus, per round,
a Poisson-subsampled (q = m / N) composition of that round's Gaussian releases (the model
update, and the clipped count or the loss where a rule makes one). The sampling recorded is
the sampling performed, not the replies that came back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import dp_accounting as dpa

from dpfit.accounting import ACCOUNTANTS, calibrate, epsilon_of
from dpfit.errors import BudgetExhaustedError, InfeasibleTargetError
from dpfit.federated.clipping import combine_multipliers

__all__ = ["ACCOUNTANTS", "BudgetExhausted", "CalibrationError", "epsilon_of"]


class BudgetExhausted(BudgetExhaustedError):
    """The next round would spend more than the target epsilon."""


class CalibrationError(InfeasibleTargetError):
    """No noise multiplier meets the target with the given sampling and rounds."""


def round_event(q: float, multipliers: Sequence[float], kind: str = "rdp") -> dpa.DpEvent:
    """One Poisson-sampled round releasing Gaussians with these multipliers.

    RDP composes the releases inside the sampling directly; PLD in dp-accounting 0.6 does not
    support that, so the releases are merged into their exact single-Gaussian equivalent.
    """
    if any(z <= 0 for z in multipliers):
        return dpa.NonPrivateDpEvent()
    if len(multipliers) == 1 or kind == "pld":
        inner: dpa.DpEvent = dpa.GaussianDpEvent(combine_multipliers(multipliers))
    else:
        inner = dpa.ComposedDpEvent([dpa.GaussianDpEvent(z) for z in multipliers])
    if q >= 1.0:
        return inner
    return dpa.PoissonSampledDpEvent(q, inner)


def training_event(
    q: float,
    rounds: int,
    round_multipliers: Sequence[float],
    one_off_multipliers: Sequence[float] = (),
    kind: str = "rdp",
) -> dpa.DpEvent:
    """The whole run: one-off releases, then ``rounds`` identical sampled rounds."""
    events: list[dpa.DpEvent] = [dpa.GaussianDpEvent(s) for s in one_off_multipliers]
    if rounds > 0:
        events.append(dpa.SelfComposedDpEvent(round_event(q, round_multipliers, kind), rounds))
    return dpa.ComposedDpEvent(events)


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    q: float,
    rounds: int,
    one_off_multipliers: Sequence[float] = (),
    kind: str = "rdp",
) -> float:
    """Combined per-round multiplier z so the whole run spends exactly ``target_epsilon``.

    Every method gets the same z; rules then split it (Theorem 1), so all meet the same
    target. One-off releases (the vote) are paid first, out of the same budget.
    """
    floor = epsilon_of(training_event(q, 0, (), one_off_multipliers, kind), delta, kind)
    if one_off_multipliers and floor >= target_epsilon:
        raise CalibrationError(
            f"the one-off releases alone spend eps={floor:.3f} >= target {target_epsilon}; "
            "raise the vote noise (--vote-noise) or the target epsilon"
        )

    def make_event(z: float) -> dpa.DpEvent:
        return training_event(q, rounds, (z,), one_off_multipliers, kind)

    try:
        return calibrate(make_event, target_epsilon, delta, kind, upper=1e4, tolerance=1e-4)
    except InfeasibleTargetError as exc:
        raise CalibrationError(
            f"cannot reach eps={target_epsilon} at delta={delta} with q={q:.4g}, "
            f"{rounds} rounds: {exc}"
        ) from exc


@dataclass
class ClientLevelAccountant:
    """Ledger of releases; epsilon is recomputed from the composed event (fast with RDP)."""

    num_clients: int
    expected_clients: float
    delta: float
    kind: str = "rdp"
    target_epsilon: float | None = None
    one_offs: list[float] = field(default_factory=list)
    rounds: list[tuple[float, ...]] = field(default_factory=list)

    @property
    def sample_rate(self) -> float:
        return min(1.0, self.expected_clients / self.num_clients)

    def event(self, extra_round: Sequence[float] | None = None) -> dpa.DpEvent:
        events: list[dpa.DpEvent] = [dpa.GaussianDpEvent(s) for s in self.one_offs]
        rounds = list(self.rounds) + ([tuple(extra_round)] if extra_round is not None else [])
        # group identical consecutive rounds so long runs stay cheap to account
        i = 0
        while i < len(rounds):
            j = i
            while j < len(rounds) and rounds[j] == rounds[i]:
                j += 1
            events.append(
                dpa.SelfComposedDpEvent(round_event(self.sample_rate, rounds[i], self.kind), j - i)
            )
            i = j
        return dpa.ComposedDpEvent(events)

    def _epsilon(self, event: dpa.DpEvent) -> float:
        if any(s <= 0 for s in self.one_offs) or any(z <= 0 for r in self.rounds for z in r):
            return math.inf
        return epsilon_of(event, self.delta, self.kind)

    def epsilon(self) -> float:
        """Epsilon spent so far at ``delta``."""
        return self._epsilon(self.event())

    def record_one_off(self, noise_multiplier: float) -> None:
        self.one_offs.append(float(noise_multiplier))

    def check_round(self, multipliers: Sequence[float]) -> float:
        """Epsilon after one more round; raises BudgetExhausted if it would pass the target."""
        if self.target_epsilon is None:
            return math.inf
        if any(z <= 0 for z in multipliers):
            eps = math.inf
        else:
            saved = self.rounds
            self.rounds = saved + [tuple(multipliers)]
            try:
                eps = self.epsilon()
            finally:
                self.rounds = saved
        if eps > self.target_epsilon * (1 + 1e-6):
            raise BudgetExhausted(
                f"round {len(self.rounds) + 1} would bring client-level epsilon to {eps:.4f} "
                f"> target {self.target_epsilon} (delta={self.delta}); stopping. Raise "
                "--epsilon, lower --rounds, or raise --noise-multiplier."
            )
        return eps

    def record_round(self, multipliers: Sequence[float]) -> None:
        self.rounds.append(tuple(float(z) for z in multipliers))

    def state_dict(self) -> dict[str, Any]:
        return {"one_offs": list(self.one_offs), "rounds": [list(r) for r in self.rounds]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.one_offs = [float(s) for s in state["one_offs"]]
        self.rounds = [tuple(float(z) for z in r) for r in state["rounds"]]

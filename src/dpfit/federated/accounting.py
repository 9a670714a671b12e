"""Client-level privacy accounting for federated rounds, as dp-accounting events.

What happened is recorded as data (a list of releases), and epsilon is computed from the
composed ``DpEvent``: one-off Gaussian releases (the DP-LAC vote histogram) plus, per round,
a Poisson-subsampled (q = m / N) composition of that round's Gaussian releases (the model
update, and the clipped count or the loss where a rule makes one), each round with the
multipliers it actually used (they change by round for a scheduled rule). The sampling recorded is
the sampling performed, not the replies that came back.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import dp_accounting as dpa

from dpfit.accounting import ACCOUNTANTS, calibrate, epsilon_of, make_accountant
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


def schedule_event(
    q: float,
    per_round: Sequence[Sequence[float]],
    one_off_multipliers: Sequence[float] = (),
    kind: str = "rdp",
    prior: dpa.DpEvent | None = None,
) -> dpa.DpEvent:
    """``prior`` (e.g. a private tuning), one-off releases, then each round with its own
    multipliers (runs of identical consecutive rounds are self-composed so that long
    fixed-noise runs stay cheap)."""
    events: list[dpa.DpEvent] = [] if prior is None else [prior]
    events += [dpa.GaussianDpEvent(s) for s in one_off_multipliers]
    rounds = [tuple(r) for r in per_round]
    i = 0
    while i < len(rounds):
        j = i
        while j < len(rounds) and rounds[j] == rounds[i]:
            j += 1
        events.append(dpa.SelfComposedDpEvent(round_event(q, rounds[i], kind), j - i))
        i = j
    return dpa.ComposedDpEvent(events)


def training_event(
    q: float,
    rounds: int,
    round_multipliers: Sequence[float],
    one_off_multipliers: Sequence[float] = (),
    kind: str = "rdp",
    prior: dpa.DpEvent | None = None,
) -> dpa.DpEvent:
    """The whole run: prior, one-off releases, then ``rounds`` identical sampled rounds."""
    return schedule_event(q, [tuple(round_multipliers)] * rounds, one_off_multipliers, kind, prior)


@functools.lru_cache(maxsize=64)
def vote_noise_for_share(
    target_epsilon: float, delta: float, share: float, kind: str = "rdp"
) -> float:
    """sigma_h of the clip-candidate vote: the Gaussian (sensitivity 1, every client votes,
    no sampling) that ALONE spends ``share`` of ``target_epsilon`` at ``delta``.

    A fixed sigma_h ignores both the budget and the number of voters; tying it to a share of
    the budget makes its privacy cost explicit, and the rounds are then calibrated with the
    vote included, so the run still meets the target.
    """
    if not 0.0 < share < 1.0:
        raise CalibrationError(f"vote budget share must be in (0, 1), got {share}")
    return calibrate(
        dpa.GaussianDpEvent, share * target_epsilon, delta, kind, upper=1e4, tolerance=1e-4
    )


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    q: float,
    rounds: int,
    one_off_multipliers: Sequence[float] = (),
    kind: str = "rdp",
    schedule: Callable[[float], Sequence[Sequence[float]]] | None = None,
    prior: dpa.DpEvent | None = None,
) -> float:
    """Combined per-round multiplier z so the whole run spends exactly ``target_epsilon``.

    Every method gets the same z; rules then split it (Theorem 1), so all meet the same
    target. ``prior`` (a private tuning) and one-off releases (the vote) are paid first, out
    of the same budget. A rule whose noise changes by round passes ``schedule``: z -> the
    multipliers of every round, and z is then its first round's multiplier.
    """
    floor = epsilon_of(training_event(q, 0, (), one_off_multipliers, kind, prior), delta, kind)
    if (one_off_multipliers or prior is not None) and floor >= target_epsilon:
        raise CalibrationError(
            f"the tuning and one-off releases alone spend eps={floor:.3f} >= target "
            f"{target_epsilon}; raise the vote noise (--vote-noise), lower the tuning's "
            "budget share or raise the target epsilon"
        )

    def make_event(z: float) -> dpa.DpEvent:
        return training_event(q, rounds, (z,), one_off_multipliers, kind, prior)

    try:
        z_const = calibrate(make_event, target_epsilon, delta, kind, upper=1e4, tolerance=1e-4)
    except InfeasibleTargetError as exc:
        raise CalibrationError(
            f"cannot reach eps={target_epsilon} at delta={delta} with q={q:.4g}, "
            f"{rounds} rounds: {exc}"
        ) from exc
    if schedule is None:
        return z_const
    return _calibrate_schedule(
        z_const, schedule, target_epsilon, delta, q, one_off_multipliers, kind, prior
    )


def _calibrate_schedule(
    z_const: float,
    schedule: Callable[[float], Sequence[Sequence[float]]],
    target_epsilon: float,
    delta: float,
    q: float,
    one_off_multipliers: Sequence[float],
    kind: str,
    prior: dpa.DpEvent | None = None,
) -> float:
    """z_0 of a schedule whose rounds scale with it (z_t = z_0 f_t, f_0 = 1 >= f_t > 0).

    Every round of schedule(z) is noisier than z f_min and less noisy than z, so the constant
    calibration z_c brackets the answer: schedule(0.99 z_c) spends more than the target and
    schedule(z_c / f_min) at most. A narrow bracket keeps the search to a few evaluations of
    the (one event per round) composition.
    """
    f_min = min(combine_multipliers(r) for r in schedule(1.0))
    if f_min <= 0:
        raise CalibrationError("a scheduled round has no noise; nothing to calibrate")

    def make_event(z: float) -> dpa.DpEvent:
        return schedule_event(q, schedule(z), one_off_multipliers, kind, prior)

    if f_min >= 1.0 - 1e-12:
        return z_const
    return float(
        dpa.calibrate_dp_mechanism(
            lambda: make_accountant(kind),
            make_event,
            target_epsilon,
            delta,
            # 0.99 z_c: every round noisier than the constant run that just met the target
            bracket_interval=dpa.ExplicitBracketInterval(0.99 * z_const, z_const / f_min),
            tol=1e-4 * z_const,
        )
    )


@dataclass
class ClientLevelAccountant:
    """Ledger of releases. ``event()`` describes the whole run; epsilon comes from a live
    dp-accounting accountant into which each release is composed once, as it is recorded
    (rounds whose noise changes would otherwise be recomputed from scratch every round)."""

    num_clients: int
    expected_clients: float
    delta: float
    kind: str = "rdp"
    target_epsilon: float | None = None
    prior: dpa.DpEvent | None = None  # spent before this run (a private tuning): counted first
    one_offs: list[float] = field(default_factory=list)
    rounds: list[tuple[float, ...]] = field(default_factory=list)
    _live: dpa.PrivacyAccountant | None = field(default=None, init=False, repr=False)
    _checked: tuple | None = field(default=None, init=False, repr=False)

    @property
    def sample_rate(self) -> float:
        return min(1.0, self.expected_clients / self.num_clients)

    def event(self, extra_round: Sequence[float] | None = None) -> dpa.DpEvent:
        """What happened, as one dp-accounting event: every round with its own multipliers."""
        rounds = list(self.rounds) + ([tuple(extra_round)] if extra_round is not None else [])
        return schedule_event(self.sample_rate, rounds, self.one_offs, self.kind, self.prior)

    def _non_private(self) -> bool:
        return any(s <= 0 for s in self.one_offs) or any(z <= 0 for r in self.rounds for z in r)

    def _accountant(self) -> dpa.PrivacyAccountant:
        if self._live is None:
            self._live = make_accountant(self.kind)
            self._live.compose(self.event())
        return self._live

    def epsilon(self) -> float:
        """Epsilon spent so far at ``delta``."""
        if self._non_private():
            return math.inf
        return float(self._accountant().get_epsilon(self.delta))

    def epsilon_if_all_continuations_released(
        self, shared_rounds: int, shared_one_offs: int, continuations: int
    ) -> float:
        """Epsilon of releasing all ``continuations`` runs that continued one checkpoint.

        What the checkpoint holds (the prior, its first ``shared_one_offs`` one-off releases
        and ``shared_rounds`` rounds) happened once; every continuation draws fresh noise
        after it, so this run's own releases count once per continuation, each assumed as
        long as this one (``dpfit.checkpoint.fork_report`` for central runs)."""
        extra = max(0, continuations - 1)
        one_offs = list(self.one_offs) + list(self.one_offs[shared_one_offs:]) * extra
        rounds = list(self.rounds) + list(self.rounds[shared_rounds:]) * extra
        if any(s <= 0 for s in one_offs) or any(z <= 0 for r in rounds for z in r):
            return math.inf
        event = schedule_event(self.sample_rate, rounds, one_offs, self.kind, self.prior)
        return float(epsilon_of(event, self.delta, self.kind))

    def record_one_off(self, noise_multiplier: float) -> None:
        self.one_offs.append(float(noise_multiplier))
        self._live = self._checked = None  # one-offs come first in the event; rebuilt lazily

    def check_round(self, multipliers: Sequence[float]) -> float:
        """Epsilon after one more round; raises BudgetExhausted if it would pass the target."""
        if self.target_epsilon is None:
            return math.inf
        if self._non_private() or any(z <= 0 for z in multipliers):
            eps = math.inf
        else:
            trial = copy.deepcopy(self._accountant())
            trial.compose(round_event(self.sample_rate, multipliers, self.kind))
            eps = float(trial.get_epsilon(self.delta))
            # record_round of the same round adopts it instead of composing it again
            self._checked = (len(self.rounds), tuple(float(z) for z in multipliers), trial)
        if eps > self.target_epsilon * (1 + 1e-6):
            raise BudgetExhausted(
                f"round {len(self.rounds) + 1} would bring client-level epsilon to {eps:.4f} "
                f"> target {self.target_epsilon} (delta={self.delta}); stopping. Raise "
                "--epsilon, lower --rounds, or raise --noise-multiplier."
            )
        return eps

    def record_round(self, multipliers: Sequence[float]) -> None:
        checked, self._checked = self._checked, None
        round_ = tuple(float(z) for z in multipliers)
        if (
            self._live is not None
            and checked is not None
            and checked[:2]
            == (
                len(self.rounds),
                round_,
            )
        ):
            self._live = checked[2]
        elif self._live is not None and not self._non_private() and all(z > 0 for z in round_):
            self._live.compose(round_event(self.sample_rate, round_, self.kind))
        else:
            self._live = None
        self.rounds.append(round_)

    def state_dict(self) -> dict[str, Any]:
        return {"one_offs": list(self.one_offs), "rounds": [list(r) for r in self.rounds]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.one_offs = [float(s) for s in state["one_offs"]]
        self.rounds = [tuple(float(z) for z in r) for r in state["rounds"]]
        self._live = self._checked = None

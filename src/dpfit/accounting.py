"""A thin adapter over dp-accounting: describe what happened as events, compute from them.

Nothing here computes a privacy bound by hand; every number comes from dp-accounting's RDP or
PLD accountant. The history is a list of plain records so it survives checkpoints as JSON.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import dp_accounting
from dp_accounting import pld, rdp

from dpfit.errors import InfeasibleTargetError

ACCOUNTANTS = ("rdp", "pld")


class _QuietOrderWarnings(logging.Filter):
    """dp-accounting warns each time an RDP order fails to converge and is left out of the
    minimum; leaving an order out only loosens the bound, so this is noise in a training log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


logging.getLogger("absl").addFilter(_QuietOrderWarnings())


@dataclass(frozen=True)
class StepRecord:
    """`count` steps of the Gaussian mechanism with `noise_multiplier`, sampled as `sampling`.

    sampling: "poisson" (amplified by q), or "none" (every example may be in every step: no
    amplification; used for shuffled or fixed batches whose sampling we cannot credit).
    """

    noise_multiplier: float
    sample_rate: float
    count: int
    sampling: str = "poisson"

    def event(self) -> dp_accounting.DpEvent:
        if self.noise_multiplier == 0:
            return dp_accounting.NonPrivateDpEvent()
        gauss = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.sampling == "poisson":
            inner: dp_accounting.DpEvent = dp_accounting.PoissonSampledDpEvent(
                self.sample_rate, gauss
            )
        elif self.sampling == "none":
            inner = gauss
        else:
            raise ValueError(f"unknown sampling {self.sampling!r}")
        return dp_accounting.SelfComposedDpEvent(inner, self.count)


def make_accountant(
    kind: str = "rdp", pld_discretization: float = 1e-4
) -> dp_accounting.PrivacyAccountant:
    if kind == "rdp":
        return rdp.RdpAccountant()
    if kind == "pld":
        return pld.PLDAccountant(value_discretization_interval=pld_discretization)
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {kind!r}")


def calibrate(
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    delta: float,
    accountant: str = "rdp",
    *,
    upper: float = 1e3,
    tolerance: float = 1e-3,
) -> float:
    """Smallest noise multiplier in [1e-3, upper] whose event meets (target_epsilon, delta).

    Raises InfeasibleTargetError (with dp-accounting's reason) when none does.
    """
    try:
        return float(
            dp_accounting.calibrate_dp_mechanism(
                lambda: make_accountant(accountant),
                make_event,
                target_epsilon,
                delta,
                bracket_interval=dp_accounting.ExplicitBracketInterval(1e-3, upper),
                tol=tolerance,
            )
        )
    except (ValueError, dp_accounting.mechanism_calibration.NoBracketIntervalFoundError) as e:
        raise InfeasibleTargetError(
            f"no noise multiplier up to {upper:g} reaches epsilon={target_epsilon} at "
            f"delta={delta}: {e}"
        ) from e


def epsilon_of(event: dp_accounting.DpEvent, delta: float, accountant: str = "rdp") -> float:
    acc = make_accountant(accountant)
    acc.compose(event)
    return float(acc.get_epsilon(delta))


def dp_sgd_event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_accounting.DpEvent:
    return StepRecord(noise_multiplier, sample_rate, steps).event()


def epsilon_for(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
) -> float:
    """Epsilon of `steps` Poisson-sampled Gaussian steps."""
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return epsilon_of(dp_sgd_event(noise_multiplier, sample_rate, steps), delta, accountant)


def noise_multiplier_for(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    *,
    extra_events: tuple[dp_accounting.DpEvent, ...] = (),
    tolerance: float = 1e-3,
) -> float:
    """Smallest noise multiplier whose composed epsilon is <= target (up to `tolerance`).

    `extra_events` are composed in too (e.g. an earlier training phase), so the result meets the
    target for the whole run.
    """
    if target_epsilon <= 0 or not 0 < target_delta < 1:
        raise InfeasibleTargetError(
            f"need target_epsilon > 0 and 0 < target_delta < 1, got ({target_epsilon}, {target_delta})"
        )

    def make_event(sigma: float) -> dp_accounting.DpEvent:
        return dp_accounting.ComposedDpEvent(
            [*extra_events, dp_sgd_event(sigma, sample_rate, steps)]
        )

    if extra_events:
        spent = epsilon_of(
            dp_accounting.ComposedDpEvent(list(extra_events)), target_delta, accountant
        )
        if spent >= target_epsilon:
            raise InfeasibleTargetError(
                f"earlier releases already spend epsilon={spent:.3f} >= target {target_epsilon}; "
                "raise the target or add noise to the earlier phase"
            )
    try:
        return calibrate(make_event, target_epsilon, target_delta, accountant, tolerance=tolerance)
    except InfeasibleTargetError as e:
        raise InfeasibleTargetError(
            f"{e}; with q={sample_rate:.4g} and {steps} steps. Use fewer steps, a smaller "
            "sampling rate or a larger epsilon"
        ) from e


@dataclass
class PrivacyLedger:
    """Mutable history of steps; epsilon is always recomputed from the records."""

    delta: float
    accountant: str = "rdp"
    records: list[StepRecord] = field(default_factory=list)

    def record(
        self, noise_multiplier: float, sample_rate: float, sampling: str = "poisson"
    ) -> None:
        last = self.records[-1] if self.records else None
        if last is not None and (last.noise_multiplier, last.sample_rate, last.sampling) == (
            noise_multiplier,
            sample_rate,
            sampling,
        ):
            self.records[-1] = StepRecord(noise_multiplier, sample_rate, last.count + 1, sampling)
        else:
            self.records.append(StepRecord(noise_multiplier, sample_rate, 1, sampling))

    @property
    def steps(self) -> int:
        return sum(r.count for r in self.records)

    def event(self, extra: tuple[StepRecord, ...] = ()) -> dp_accounting.DpEvent:
        return dp_accounting.ComposedDpEvent([r.event() for r in (*self.records, *extra)])

    def epsilon(self, delta: float | None = None, extra: tuple[StepRecord, ...] = ()) -> float:
        records = (*self.records, *extra)
        if not records:
            return 0.0
        if any(r.noise_multiplier == 0 for r in records):
            return math.inf
        return epsilon_of(
            self.event(extra), self.delta if delta is None else delta, self.accountant
        )

    def state_dict(self) -> dict:
        return {
            "delta": self.delta,
            "accountant": self.accountant,
            "records": [r.__dict__.copy() for r in self.records],
        }

    @classmethod
    def from_state_dict(cls, sd: dict) -> PrivacyLedger:
        return cls(sd["delta"], sd["accountant"], [StepRecord(**r) for r in sd["records"]])

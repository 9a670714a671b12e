"""A thin adapter over dp-accounting: describe what happened as events, compute from them.

Nothing here computes a privacy bound by hand; every number comes from dp-accounting's RDP or
PLD accountant. The history is a list of plain records so it survives checkpoints as JSON.

A ledger's epsilon is asked for after every training step, and dp-accounting spends nearly
all of its time on one step's mechanism (RDP: its curve over the orders; PLD: its privacy loss
distribution), not on composing it. `ledger_epsilon` keeps that one-step result per mechanism
and composes it the way the accountant itself does (RDP: count x curve, summed; PLD:
self-composed count times, then composed), so the number is the accountant's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import dp_accounting
import numpy as np
from dp_accounting import pld, rdp

from dpfit.errors import AccountingError, InfeasibleTargetError

ACCOUNTANTS = ("rdp", "pld")

# Which datasets are neighbours. add-remove: one differs from the other by one example more or
# less (the size differs). replace-one: one example is swapped for another (same size). When n
# is public, as it is in every dpfit report (train_examples, q = B/n), neighbours have equal
# size, so replace-one is the relation that matches what an observer knows; its epsilon is
# larger for the same noise. Both are always reported; a run is calibrated to one of them.
NEIGHBOURING = ("add-remove", "replace-one")
DEFAULT_NEIGHBOURING = "add-remove"
_RELATIONS = {
    "add-remove": dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    "replace-one": dp_accounting.NeighboringRelation.REPLACE_ONE,
}

log = logging.getLogger(__name__)


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


def check_neighbouring(neighbouring: str) -> str:
    if neighbouring not in NEIGHBOURING:
        raise ValueError(f"neighbouring must be one of {NEIGHBOURING}, got {neighbouring!r}")
    return neighbouring


def accountant_for(accountant: str, neighbouring: str = DEFAULT_NEIGHBOURING) -> str:
    """The accountant that computes `neighbouring`'s epsilon when `accountant` is asked for.

    dp-accounting's RDP accountant has no replace-one analysis of a Poisson-sampled Gaussian
    (it refuses the event), its PLD accountant has an exact one: replace-one numbers always
    come from PLD."""
    check_neighbouring(neighbouring)
    return "pld" if neighbouring == "replace-one" else accountant


def make_accountant(
    kind: str = "rdp",
    pld_discretization: float = 1e-4,
    neighbouring: str = DEFAULT_NEIGHBOURING,
) -> dp_accounting.PrivacyAccountant:
    """A fresh accountant for the neighbouring relation. PLD's discretisation is pessimistic:
    a coarser grid only loosens the bound."""
    relation = _RELATIONS[check_neighbouring(neighbouring)]
    if kind == "rdp":
        return rdp.RdpAccountant(neighboring_relation=relation)
    if kind == "pld":
        return pld.PLDAccountant(
            neighboring_relation=relation, value_discretization_interval=pld_discretization
        )
    raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {kind!r}")


PLD_DISCRETIZATION = 1e-4  # what epsilons are reported with
PLD_SEARCH_DISCRETIZATION = 1e-3  # ~10x faster, looser (pessimistic) bound: for searching


def _gap(
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    delta: float,
    accountant: str,
    discretization: float = PLD_DISCRETIZATION,
    neighbouring: str = DEFAULT_NEIGHBOURING,
) -> Callable[[float], float]:
    return lambda sigma: (
        epsilon_of(make_event(sigma), delta, accountant, discretization, neighbouring)
        - target_epsilon
    )


def _calibrate_rdp(
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    delta: float,
    upper: float,
    tolerance: float,
) -> float:
    """RDP copes with any sigma cheaply, so it may search the whole range [1e-3, upper]."""
    try:
        return float(
            dp_accounting.calibrate_dp_mechanism(
                lambda: make_accountant("rdp"),
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
            f"delta={delta}"  # the root finder's own words (in __cause__) help no user
        ) from e


def _calibrate_pld(
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    delta: float,
    upper: float,
    tolerance: float,
    neighbouring: str = DEFAULT_NEIGHBOURING,
) -> float:
    """PLD, bracketed by RDP. RDP's sigma meets the target under PLD too (PLD is the tighter
    bound for the same events) and PLD seldom needs less than ~60% of it; probing only that
    bracket keeps PLD away from tiny sigmas, where its support (and memory) explodes. The
    search uses a coarser (still pessimistic) grid; the result is checked on the fine one.
    Replace-one starts from RDP's add-remove sigma too (RDP has no replace-one analysis
    here) and widens upwards from it, as replace-one needs more noise."""
    hi = _calibrate_rdp(make_event, target_epsilon, delta, upper, tolerance)
    coarse = _gap(make_event, target_epsilon, delta, "pld", PLD_SEARCH_DISCRETIZATION, neighbouring)
    fine = _gap(make_event, target_epsilon, delta, "pld", PLD_DISCRETIZATION, neighbouring)
    g_hi = coarse(hi)
    while g_hi > 0:  # PLD's discretisation made it looser here: widen upwards
        hi *= 1.1
        if hi > upper:
            raise InfeasibleTargetError(
                f"no noise multiplier up to {upper:g} reaches epsilon={target_epsilon} at "
                f"delta={delta} under the PLD accountant"
            )
        g_hi = coarse(hi)
    lo, g_lo = hi, g_hi
    for _ in range(4):  # down to hi * 0.8^4 = 0.41 hi
        lo *= 0.8
        g_lo = coarse(lo)
        if g_lo > 0:  # bracketed: dp-accounting's own search, on the coarse grid
            hi = float(
                dp_accounting.calibrate_dp_mechanism(
                    lambda: make_accountant("pld", PLD_SEARCH_DISCRETIZATION, neighbouring),
                    make_event,
                    target_epsilon,
                    delta,
                    bracket_interval=dp_accounting.ExplicitBracketInterval(lo, hi),
                    tol=tolerance,
                )
            )
            break
        hi, g_hi = lo, g_lo
    else:
        log.info("PLD calibration: sigma=%.4g (0.41 x RDP's) already meets the target", hi)
    while fine(hi) > 0:  # the fine grid is what epsilon is reported with
        hi += tolerance
    return hi


def calibrate(
    make_event: Callable[[float], dp_accounting.DpEvent],
    target_epsilon: float,
    delta: float,
    accountant: str = "rdp",
    *,
    upper: float = 1e3,
    tolerance: float = 1e-3,
    neighbouring: str = DEFAULT_NEIGHBOURING,
) -> float:
    """Smallest noise multiplier in [1e-3, upper] (to `tolerance`) whose event meets
    (target_epsilon, delta) for `neighbouring` datasets: epsilon(result) <= target_epsilon.

    Raises InfeasibleTargetError when none does, AccountingError when the accountant fails.
    """
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    if accountant_for(accountant, neighbouring) == "rdp":
        return _calibrate_rdp(make_event, target_epsilon, delta, upper, tolerance)
    return _calibrate_pld(make_event, target_epsilon, delta, upper, tolerance, neighbouring)


def epsilon_of(
    event: dp_accounting.DpEvent,
    delta: float,
    accountant: str = "rdp",
    pld_discretization: float = PLD_DISCRETIZATION,
    neighbouring: str = DEFAULT_NEIGHBOURING,
) -> float:
    """Epsilon of `event` at `delta` for `neighbouring` datasets (replace-one: always from
    PLD, see accountant_for); an accountant failure becomes an AccountingError."""
    accountant = accountant_for(accountant, neighbouring)
    with _accountant_errors(accountant):
        acc = make_accountant(accountant, pld_discretization, neighbouring)
        acc.compose(event)
        return float(acc.get_epsilon(delta))


@contextlib.contextmanager
def _accountant_errors(accountant: str) -> Iterator[None]:
    """An accountant running out of memory or range becomes an AccountingError."""
    try:
        yield
    except (MemoryError, OverflowError, FloatingPointError) as e:
        raise AccountingError(
            f"the {accountant.upper()} accountant failed ({type(e).__name__}: {str(e)[:120]}) "
            "for these settings; PLD's support grows without bound as the noise multiplier "
            "shrinks. Use the RDP accountant, or more noise (a smaller epsilon, fewer steps)."
        ) from e


@functools.lru_cache(maxsize=64)
def _one_step_rdp(step: StepRecord, neighbouring: str) -> tuple[np.ndarray, np.ndarray]:
    """dp-accounting's orders and RDP curve of one step of `step`'s mechanism (count 1)."""
    acc = make_accountant("rdp", neighbouring=neighbouring)
    acc.compose(step.event())
    orders, curve = acc.orders, acc.rdp
    orders.flags.writeable = curve.flags.writeable = False  # shared by every later call
    return orders, curve


@functools.lru_cache(maxsize=8)  # a PLD holds a few MB; a run uses one or two
def _one_step_pld(step: StepRecord, neighbouring: str, discretization: float):
    """dp-accounting's privacy loss distribution of one Poisson-sampled Gaussian step, built as
    its PLD accountant builds it."""
    return pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=step.noise_multiplier,
        value_discretization_interval=discretization,
        sampling_prob=step.sample_rate,
        neighboring_relation=_RELATIONS[neighbouring],
    )


def ledger_epsilon(
    records: Sequence[StepRecord],
    delta: float,
    accountant: str = "rdp",
    pld_discretization: float = PLD_DISCRETIZATION,
    neighbouring: str = DEFAULT_NEIGHBOURING,
) -> float:
    """`epsilon_of` the records' composed event, from cached one-step results.

    RDP: the accountant adds count x (one step's curve) per record to a zero curve, and so does
    this, in the same order, so the sum and the epsilon are the same floats. PLD: the accountant
    composes each record's one-step distribution self-composed count times onto the identity,
    and so does this. Under PLD, records without Poisson sampling or at q = 0 (built another
    way there) take the accountant's own path.
    """
    accountant = accountant_for(accountant, neighbouring)
    if not records:
        return 0.0
    if any(r.noise_multiplier == 0 for r in records):
        return math.inf
    ones = [dataclasses.replace(r, count=1) for r in records]
    with _accountant_errors(accountant):
        if accountant == "rdp":
            total = None
            for r, one in zip(records, ones, strict=True):
                orders, curve = _one_step_rdp(one, neighbouring)
                total = np.zeros_like(orders, dtype=np.float64) if total is None else total
                total += r.count * curve
            return float(rdp.compute_epsilon(orders, total, delta)[0])
        if all(r.sampling == "poisson" and r.sample_rate > 0 for r in records):
            composed = pld.privacy_loss_distribution.identity(
                value_discretization_interval=pld_discretization
            )
            for r, one in zip(records, ones, strict=True):
                step = _one_step_pld(one, neighbouring, pld_discretization)
                composed = composed.compose(step.self_compose(r.count))
            return float(composed.get_epsilon_for_delta(delta))
    event = dp_accounting.ComposedDpEvent([r.event() for r in records])
    return epsilon_of(event, delta, accountant, pld_discretization, neighbouring)


def dp_sgd_event(noise_multiplier: float, sample_rate: float, steps: int) -> dp_accounting.DpEvent:
    return StepRecord(noise_multiplier, sample_rate, steps).event()


def epsilon_for(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    accountant: str = "rdp",
    neighbouring: str = DEFAULT_NEIGHBOURING,
) -> float:
    """Epsilon of `steps` Poisson-sampled Gaussian steps for `neighbouring` datasets."""
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return epsilon_of(
        dp_sgd_event(noise_multiplier, sample_rate, steps),
        delta,
        accountant,
        neighbouring=neighbouring,
    )


def noise_multiplier_for(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "rdp",
    *,
    extra_events: tuple[dp_accounting.DpEvent, ...] = (),
    tolerance: float = 1e-3,
    neighbouring: str = DEFAULT_NEIGHBOURING,
) -> float:
    """Smallest noise multiplier whose composed epsilon is <= target (up to `tolerance`) for
    `neighbouring` datasets.

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
            dp_accounting.ComposedDpEvent(list(extra_events)),
            target_delta,
            accountant,
            neighbouring=neighbouring,
        )
        if spent >= target_epsilon:
            raise InfeasibleTargetError(
                f"earlier releases already spend epsilon={spent:.3f} >= target {target_epsilon}; "
                "raise the target or add noise to the earlier phase"
            )
    try:
        return calibrate(
            make_event,
            target_epsilon,
            target_delta,
            accountant,
            tolerance=tolerance,
            neighbouring=neighbouring,
        )
    except InfeasibleTargetError as e:
        raise InfeasibleTargetError(
            f"{e}; with q={sample_rate:.4g} and {steps} steps. Use fewer steps, a smaller "
            "sampling rate or a larger epsilon"
        ) from e


@dataclass
class PrivacyLedger:
    """Mutable history of steps; epsilon is always recomputed from the records.

    `neighbouring` is the relation `epsilon()` reports by default (the one a run is calibrated
    and budgeted to); `epsilons()` gives both.
    """

    delta: float
    accountant: str = "rdp"
    records: list[StepRecord] = field(default_factory=list)
    neighbouring: str = DEFAULT_NEIGHBOURING

    def __post_init__(self) -> None:
        check_neighbouring(self.neighbouring)

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

    def prefix(self, steps: int) -> PrivacyLedger:
        """The ledger as it stood after its first `steps` steps: the epsilon of a past step
        is a function of the step count alone, whatever happened since."""
        if not 0 <= steps <= self.steps:
            raise ValueError(f"steps must be in [0, {self.steps}], got {steps}")
        kept: list[StepRecord] = []
        left = steps
        for r in self.records:
            if left == 0:
                break
            kept.append(dataclasses.replace(r, count=min(r.count, left)))
            left -= kept[-1].count
        return dataclasses.replace(self, records=kept)

    def event(self, extra: tuple[StepRecord, ...] = ()) -> dp_accounting.DpEvent:
        return dp_accounting.ComposedDpEvent([r.event() for r in (*self.records, *extra)])

    def epsilon(
        self,
        delta: float | None = None,
        extra: tuple[StepRecord, ...] = (),
        pld_discretization: float = PLD_DISCRETIZATION,
        neighbouring: str | None = None,
    ) -> float:
        return ledger_epsilon(
            (*self.records, *extra),
            self.delta if delta is None else delta,
            self.accountant,
            pld_discretization,
            self.neighbouring if neighbouring is None else neighbouring,
        )

    def epsilons(self, delta: float | None = None) -> dict[str, float]:
        """Epsilon for each neighbouring relation, e.g. {"add-remove": 8.0, "replace-one": 9.5}."""
        return {rel: self.epsilon(delta, neighbouring=rel) for rel in NEIGHBOURING}

    def state_dict(self) -> dict:
        return {
            "delta": self.delta,
            "accountant": self.accountant,
            "neighbouring": self.neighbouring,
            "records": [r.__dict__.copy() for r in self.records],
        }

    @classmethod
    def from_state_dict(cls, sd: dict) -> PrivacyLedger:
        return cls(
            sd["delta"],
            sd["accountant"],
            [StepRecord(**r) for r in sd["records"]],
            sd.get(
                "neighbouring", DEFAULT_NEIGHBOURING
            ),  # checkpoints written before the relation was recorded
        )


def max_steps_within(
    ledger: PrivacyLedger,
    target_epsilon: float | None,
    noise_multiplier: float,
    sample_rate: float,
    planned_steps: int | None,
    accountant: str,
) -> int | None:
    """Largest total step count (the ledger's steps plus more at `noise_multiplier` and
    `sample_rate`) whose epsilon stays within `target_epsilon`; None without a target."""
    target = target_epsilon
    if target is None:
        return None
    if noise_multiplier == 0:
        return ledger.steps

    def fits(k: int, grid: float = PLD_DISCRETIZATION) -> bool:
        extra = (StepRecord(noise_multiplier, sample_rate, k),) if k else ()
        return ledger.epsilon(extra=extra, pld_discretization=grid) <= target

    # PLD: search on a coarser (pessimistic, so never larger) grid, then settle on the
    # grid epsilon is reported with; RDP ignores the grid
    search = PLD_SEARCH_DISCRETIZATION
    if not fits(0):
        return ledger.steps

    def last_fitting(lo: int, hi: int, grid: float) -> int:
        """Given fits(lo) and not fits(hi): the largest k in [lo, hi) that fits."""
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid, grid) else (lo, mid)
        return lo

    lo, hi = 0, max(1, planned_steps or 1)
    while fits(hi, search):
        lo, hi = hi, hi * 2
        if hi > 10**9:
            return None
    lo = last_fitting(lo, hi, search)
    if accountant_for(accountant, ledger.neighbouring) == "pld":  # settle on the reporting grid
        if not fits(lo):
            lo = last_fitting(0, lo, PLD_DISCRETIZATION)
        else:
            step = 1
            while fits(lo + step):
                lo, step = lo + step, step * 2
            lo = last_fitting(lo, lo + step, PLD_DISCRETIZATION)
    return ledger.steps + lo

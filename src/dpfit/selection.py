"""Private selection among candidate runs (Papernot & Steinke's random stopping), framework-free.

Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022
(arXiv:2110.03620). Run a randomised candidate Q K times, K drawn from a distribution fixed
in advance, each time with a grid point drawn uniformly, and release only the best
(output, score). If one run of Q is (lambda, eps)- and (lambda_hat, eps_hat)-RDP:

- Theorem 2 (K ~ truncated negative binomial D_{eta,gamma}, Definition 1; eta = 1 is the
  geometric and eta = 0 the logarithmic distribution): the selection is (lambda, eps')-RDP with
  eps' = eps + (1+eta)(1 - 1/lambda_hat) eps_hat + (1+eta) log(1/gamma) / lambda_hat
  + log(E[K]) / (lambda - 1);
- Theorem 6 (K ~ Poisson(mu)): eps' = eps + mu delta_hat + log(mu) / (lambda - 1).

What the theorems cover: the best run's *whole* output (its model, its grid point, its score).
What they do not: K, the other runs' grid points and scores, and anything that reveals them
(the tuning's wall time). dp-accounting's ``RepeatAndSelectDpEvent(event, mean, shape)``
implements both bounds (RDP only; PLD does not support it). Q's RDP must bound every grid
point's: Renyi divergence is jointly quasi-convex, so a uniform draw over grid points whose
curves all lie under one reference curve is bounded by that curve
(:func:`dominating_multiplier` finds, for a shorter run, the smallest noise that keeps it under).

Used by the federated baselines' tuning (:mod:`dpfit.federated.tuning`) and by
``dpfit train --tune`` (:mod:`dpfit.run.tune`).
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import dp_accounting as dpa
import numpy as np
from dp_accounting import rdp
from scipy import optimize, stats

from dpfit.errors import DPFitError

logger = logging.getLogger(__name__)

P = TypeVar("P")  # a grid point


class SelectionError(DPFitError):
    """A private selection was asked for something its privacy bound does not cover."""


@dataclass(frozen=True)
class RunCount:
    """How many candidate runs: a distribution (never a fixed number), E[K] and its shape.

    ``shape`` is eta of the truncated negative binomial (0: logarithmic, 1: geometric,
    ``math.inf``: Poisson, which may run no candidate at all); ``mean_runs`` is E[K].
    """

    mean_runs: float = 3.0
    shape: float = 1.0

    def __post_init__(self) -> None:
        if not (self.mean_runs >= 1 and math.isfinite(self.mean_runs)):
            raise SelectionError(f"mean_runs must be a finite number >= 1, got {self.mean_runs}")
        if math.isnan(self.shape) or self.shape < 0:
            raise SelectionError(f"shape must be >= 0 (or inf for Poisson), got {self.shape}")

    def describe(self) -> str:
        if math.isinf(self.shape):
            family = "Poisson"
        elif self.shape == 0:
            family = "logarithmic (truncated negative binomial, eta 0)"
        elif self.shape == 1:
            family = "geometric (truncated negative binomial, eta 1)"
        else:
            family = f"truncated negative binomial, eta {self.shape:g}"
        return f"{family}, mean {self.mean_runs:g}"


# --------------------------------------------------------------------------------------------
# The number of runs K (Papernot & Steinke, Definition 1)
# --------------------------------------------------------------------------------------------


def tnb_mean(gamma: float, shape: float) -> float:
    """E[K] of the truncated negative binomial D_{eta,gamma} (Papernot & Steinke, Sec. 2)."""
    if shape == 0:
        return (1.0 / gamma - 1.0) / math.log(1.0 / gamma)
    return shape * (1.0 - gamma) / (gamma * (1.0 - gamma**shape))


def tnb_gamma(mean: float, shape: float) -> float:
    """gamma in (0, 1) whose D_{shape,gamma} has E[K] = ``mean`` (E[K] falls as gamma grows)."""
    if mean == 1.0:
        return 1.0
    if shape == 1.0:
        return 1.0 / mean
    return float(
        optimize.brentq(lambda g: tnb_mean(g, shape) - mean, 1e-12, 1.0 - 1e-12, xtol=1e-14)
    )


def draw_runs(runs: RunCount, rng: np.random.Generator) -> int:
    """K ~ D_{eta,gamma} with E[K] = mean_runs (or Poisson(mean_runs) for shape = inf)."""
    mean, shape = runs.mean_runs, runs.shape
    if math.isinf(shape):
        return int(rng.poisson(mean))
    gamma = tnb_gamma(mean, shape)
    if gamma >= 1.0:
        return 1
    if shape == 0:  # logarithmic: P[K = k] proportional to (1 - gamma)^k / k
        return int(stats.logser.rvs(1.0 - gamma, random_state=rng))
    while True:  # negative binomial (failures before `shape` successes), conditioned on >= 1
        k = int(rng.negative_binomial(shape, gamma))
        if k >= 1:
            return k


def selection_rng(insecure_seed: int | None = None) -> np.random.Generator:
    """The generator for K, the grid draws and score noise: OS entropy unless an insecure
    seed is given (benchmarks, --insecure-reproducible-noise)."""
    if insecure_seed is None:
        return np.random.default_rng(secrets.randbits(128))
    logger.warning(
        "insecure_seed=%d: the number of candidate runs and their hyperparameters are "
        "reproducible from this number; the selection's bound assumes they are secret",
        insecure_seed,
    )
    return np.random.default_rng([int(insecure_seed), 0x7E5E])


# --------------------------------------------------------------------------------------------
# Accounting
# --------------------------------------------------------------------------------------------


def selection_event(candidate: dpa.DpEvent, mean_runs: float, shape: float) -> dpa.DpEvent:
    """The selection over K candidate runs, each bounded by ``candidate`` (Theorems 2 and 6)."""
    return dpa.dp_event.RepeatAndSelectDpEvent(candidate, float(mean_runs), float(shape))


def rdp_curve(event: dpa.DpEvent) -> tuple[np.ndarray, np.ndarray]:
    """(orders, RDP at each order) of ``event``, add-or-remove neighbours, by dp-accounting's
    RDP accountant at its default orders (the orders it also bounds a selection at)."""
    acc = rdp.RdpAccountant()
    acc.compose(event)
    return np.asarray(acc._orders, dtype=np.float64), np.asarray(acc._rdp, dtype=np.float64)


def dominating_multiplier(
    make_event: Callable[[float], dpa.DpEvent],
    reference: dpa.DpEvent,
    upper: float,
    rel_tol: float = 1e-4,
) -> float:
    """The smallest noise multiplier z (to ``rel_tol``, rounded up) whose ``make_event(z)`` has
    an RDP curve at or below ``reference``'s at every order: a grid point that runs fewer
    steps than the reference then needs less noise to be bounded by it. ``upper`` must
    dominate (e.g. the reference's own z for a run with fewer steps at the same rate)."""
    _, ref = rdp_curve(reference)

    def under(z: float) -> bool:
        return bool(np.all(rdp_curve(make_event(z))[1] <= ref))

    if not under(upper):
        raise SelectionError(
            f"noise multiplier {upper} does not keep the run under the reference curve"
        )
    lo = upper / 2
    while under(lo):
        lo /= 2
        if lo < 1e-6:
            return lo
    hi = upper
    while hi - lo > rel_tol * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if under(mid) else (mid, hi)
    return hi


# --------------------------------------------------------------------------------------------
# The selection itself
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Best(Generic[P]):
    """The released result: the best grid point, its score and its run's output (None: no
    run was drawn). ``runs`` (K) is NOT releasable; it is kept for the operator and tests."""

    choice: P | None
    score: float
    output: Any
    runs: int


def select_best(
    grid: Sequence[P],
    run_candidate: Callable[[P, int], tuple[float, Any]],
    runs: RunCount,
    rng: np.random.Generator,
) -> Best[P]:
    """Draw K, run K candidates (grid point uniform at random), keep the highest score.

    ``run_candidate(point, i)`` runs candidate i with ``point`` and returns (score, output);
    the score must itself be private or computed from public data. Only the best run's
    output is kept (the others are dropped as soon as they lose). Ties keep the earlier run;
    a non-finite score never wins.
    """
    if not grid:
        raise SelectionError("the tuning grid is empty")
    k = draw_runs(runs, rng)
    best: P | None = None
    best_out: Any = None
    best_score = -math.inf
    for i in range(k):
        point = grid[int(rng.integers(len(grid)))]
        score, out = run_candidate(point, i)
        score = float(score)
        score = score if math.isfinite(score) else -math.inf  # a diverged run never wins
        if best is None or score > best_score:
            best, best_score, best_out = point, score, out
        del out
    return Best(best, best_score, best_out, k)


def grid_points(grid: Sequence[Mapping[str, Any]]) -> list[dict]:
    """The grid as plain dicts (what a record states as public)."""
    return [dict(p) for p in grid]

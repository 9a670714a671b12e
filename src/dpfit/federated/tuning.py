"""Private hyperparameter selection for federated baselines (random-repetition selection).

Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022
(arXiv:2110.03620). The selection runs K candidate trainings, K drawn from a distribution
fixed in advance, each with a hyperparameter drawn uniformly from the grid, scores each
released model on the server's public validation split, and releases only the best
(hyperparameter, score). If one candidate run is (lambda, eps)- and (lambda_hat, eps_hat)-RDP:

- Theorem 2 (K ~ truncated negative binomial D_{eta,gamma}, Definition 1; eta = 1 is the
  geometric and eta = 0 the logarithmic distribution): the selection is (lambda, eps')-RDP with
  eps' = eps + (1+eta)(1 - 1/lambda_hat) eps_hat + (1+eta) log(1/gamma) / lambda_hat
  + log(E[K]) / (lambda - 1);
- Theorem 6 (K ~ Poisson(mu)): eps' = eps + mu delta_hat + log(mu) / (lambda - 1), delta_hat the
  (log(1 + 1/(lambda-1)), delta_hat)-DP of one run.

dp-accounting's ``RepeatAndSelectDpEvent(event, mean, shape)`` implements both bounds (its RDP
accountant only; PLD does not support it); this module draws K exactly as they assume and
describes the spend as that event. Budget split (the protocol of the DP-LAC paper): the
candidates' noise is calibrated so the selection alone spends ``budget_share`` of the target;
the final training run is then calibrated so that selection and training *composed* meet the
whole target, and its ledger starts with the selection, so every epsilon it reports includes
the tuning.

Only the best (hyperparameter, score) may be released. K, the hyperparameters tried, the
other scores and the tuning wall time (which reveals K) are secret: the bound does not hold
for the selection released together with K. Their randomness comes from the OS unless an
insecure seed is given (benchmarks), like the server's noise.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import dp_accounting as dpa
import numpy as np
from scipy import optimize, stats

from dpfit.accounting import calibrate, epsilon_of
from dpfit.errors import DPFitError, InfeasibleTargetError
from dpfit.federated.accounting import schedule_event
from dpfit.federated.clipping import clip_rule_class

if TYPE_CHECKING:
    from dpfit.federated.strategy import ServerConfig

logger = logging.getLogger(__name__)


class TuningError(DPFitError):
    """A private selection was asked for something its privacy bound does not cover."""


@dataclass(frozen=True)
class SelectionConfig:
    """How many candidate runs (a distribution, never a fixed number) and the budget share.

    ``shape`` is eta of the truncated negative binomial (0: logarithmic, 1: geometric,
    ``math.inf``: Poisson, which may run no candidate at all); ``mean_runs`` is E[K].
    """

    mean_runs: float = 3.0
    shape: float = 1.0
    budget_share: float = 1.0 / 3.0

    def __post_init__(self) -> None:
        if not (self.mean_runs >= 1 and math.isfinite(self.mean_runs)):
            raise TuningError(f"mean_runs must be a finite number >= 1, got {self.mean_runs}")
        if math.isnan(self.shape) or self.shape < 0:
            raise TuningError(f"shape must be >= 0 (or inf for Poisson), got {self.shape}")
        if not 0.0 < self.budget_share < 1.0:
            raise TuningError(f"budget_share must be in (0, 1), got {self.budget_share}")


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


def draw_runs(selection: SelectionConfig, rng: np.random.Generator) -> int:
    """K ~ D_{eta,gamma} with E[K] = mean_runs (or Poisson(mean_runs) for shape = inf)."""
    mean, shape = selection.mean_runs, selection.shape
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


# --------------------------------------------------------------------------------------------
# Accounting
# --------------------------------------------------------------------------------------------


def run_event(config: ServerConfig, noise_multiplier: float) -> dpa.DpEvent:
    """One whole training run of ``config`` at combined multiplier z, as its ledger records it:
    the rule's one-off releases, then every round's releases (scheduled rules: z_t)."""
    rule_cls = clip_rule_class(config.method)
    clip = config.clip_config(noise_multiplier)
    return schedule_event(
        config.sample_rate,
        rule_cls.schedule(clip, config.rounds),
        rule_cls.one_off_multipliers(clip),
        config.accountant,
    )


def selection_event(candidate: dpa.DpEvent, mean_runs: float, shape: float) -> dpa.DpEvent:
    """The selection over K candidate runs, each ``candidate`` (Theorems 2 and 6)."""
    return dpa.dp_event.RepeatAndSelectDpEvent(candidate, float(mean_runs), float(shape))


def tuning_event(config: ServerConfig) -> dpa.DpEvent | None:
    """The selection a final run was tuned by (None if it was not), from its config."""
    if config.tuning_noise_multiplier is None:
        return None
    candidate = run_event(config, config.tuning_noise_multiplier)
    return selection_event(candidate, config.tuning_mean_runs, config.tuning_shape)


def check_grid(config: ServerConfig, grid: Sequence[Mapping[str, Any]]) -> None:
    """Every grid point must cost the same per run: the bound takes one candidate's RDP.

    A hyperparameter that changes the noise (e.g. ``noise_decay`` of the dynamic rule) would
    make the candidate's privacy depend on the draw; such grids are refused.
    """
    if not grid:
        raise TuningError("the tuning grid is empty")
    base = run_event(config, 1.0)
    for point in grid:
        if run_event(replace(config, **point), 1.0) != base:
            raise TuningError(
                f"grid point {dict(point)} changes the noise of a run; a private selection "
                "needs every candidate to spend the same (tune only parameters such as the "
                "clip norm, the target quantile or the clip decay)"
            )


@dataclass(frozen=True)
class TuningPlan:
    """Candidate runs at ``candidate_noise_multiplier``, then the final run (``final``)."""

    candidate: ServerConfig  # fixed z for every candidate run, no budget stop of its own
    final: ServerConfig  # the whole target; its ledger starts with the selection
    candidate_noise_multiplier: float
    selection: SelectionConfig
    tuning_epsilon: float  # what the selection alone spends at delta
    candidate_epsilon: float  # one candidate run alone (without the selection's overhead)


def plan_tuning(
    config: ServerConfig,
    grid: Sequence[Mapping[str, Any]],
    selection: SelectionConfig = SelectionConfig(),
) -> TuningPlan:
    """Split ``config.target_epsilon``: ``budget_share`` for the selection, the rest to train."""
    if config.target_epsilon is None or config.noise_multiplier is not None:
        raise TuningError("private tuning splits a target epsilon: give target_epsilon only")
    if config.accountant != "rdp":
        raise TuningError(
            "the private selection is accounted with RDP (Papernot & Steinke's bounds); "
            "dp-accounting's PLD accountant does not support it: use accountant='rdp'"
        )
    if config.tuning_noise_multiplier is not None:
        raise TuningError("this config was already tuned; plan from the untuned one")
    check_grid(config, grid)
    target = selection.budget_share * config.target_epsilon

    def make_event(z: float) -> dpa.DpEvent:
        return selection_event(run_event(config, z), selection.mean_runs, selection.shape)

    try:
        z = calibrate(make_event, target, config.delta, "rdp", upper=1e4, tolerance=1e-4)
    except InfeasibleTargetError as exc:
        raise TuningError(
            f"the selection cannot spend only {target:.4g} of eps={config.target_epsilon}: "
            f"{exc}. Raise the budget share, lower mean_runs or add rounds' noise."
        ) from exc
    final = replace(
        config,
        tuning_noise_multiplier=z,
        tuning_mean_runs=selection.mean_runs,
        tuning_shape=selection.shape,
    )
    candidate = replace(config, target_epsilon=None, noise_multiplier=z)
    return TuningPlan(
        candidate=candidate,
        final=final,
        candidate_noise_multiplier=z,
        selection=selection,
        tuning_epsilon=epsilon_of(make_event(z), config.delta, "rdp"),
        candidate_epsilon=epsilon_of(run_event(config, z), config.delta, "rdp"),
    )


# --------------------------------------------------------------------------------------------
# The selection itself
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """The released result: the best grid point and its score (None: no run was drawn).

    ``runs`` (K) is NOT releasable; it is kept for the operator and for benchmarks.
    """

    choice: Mapping[str, Any] | None
    score: float
    runs: int


def selection_rng(insecure_seed: int | None = None) -> np.random.Generator:
    """The generator for K and the grid draws: OS entropy unless an insecure seed is given."""
    if insecure_seed is None:
        return np.random.default_rng(secrets.randbits(128))
    logger.warning(
        "insecure_seed=%d: the number of candidate runs and their hyperparameters are "
        "reproducible from this number; the selection's bound assumes they are secret",
        insecure_seed,
    )
    return np.random.default_rng([int(insecure_seed), 0x7E5E])


def private_selection(
    grid: Sequence[Mapping[str, Any]],
    run_candidate: Callable[[Mapping[str, Any], int], float],
    selection: SelectionConfig,
    rng: np.random.Generator,
) -> Selection:
    """Draw K, run K candidates (grid point uniform at random), keep the highest score.

    ``run_candidate(point, i)`` trains candidate i with ``point`` at the plan's candidate
    noise and returns a score computed from its released model on public data only (e.g.
    accuracy on the server's validation split). Ties keep the earlier run.
    """
    if not grid:
        raise TuningError("the tuning grid is empty")
    k = draw_runs(selection, rng)
    best: Mapping[str, Any] | None = None
    best_score = -math.inf
    for i in range(k):
        point = grid[int(rng.integers(len(grid)))]
        score = float(run_candidate(point, i))
        score = score if math.isfinite(score) else -math.inf  # a diverged run never wins
        if best is None or score > best_score:
            best, best_score = point, score
    return Selection(best, best_score, k)

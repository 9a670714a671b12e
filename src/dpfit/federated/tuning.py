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
accountant only; PLD does not support it); the shared core :mod:`dpfit.selection` draws K
exactly as they assume and describes the spend as that event. Budget split (the protocol of the DP-LAC paper): the
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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import dp_accounting as dpa
import numpy as np

from dpfit.accounting import calibrate, epsilon_of
from dpfit.errors import InfeasibleTargetError
from dpfit.federated.accounting import schedule_event
from dpfit.federated.clipping import clip_rule_class
from dpfit.selection import (  # noqa: F401 - the shared core; its names stay importable here
    RunCount,
    SelectionError,
    draw_runs,
    select_best,
    selection_event,
    selection_rng,
    tnb_gamma,
    tnb_mean,
)

if TYPE_CHECKING:
    from dpfit.federated.server_config import ServerConfig

logger = logging.getLogger(__name__)


TuningError = SelectionError  # one class: the shared core raises it for both


@dataclass(frozen=True)
class SelectionConfig(RunCount):
    """How many candidate runs (:class:`dpfit.selection.RunCount`) and the budget share the
    selection takes of the target (the final run gets the rest, composed)."""

    budget_share: float = 1.0 / 3.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.budget_share < 1.0:
            raise TuningError(f"budget_share must be in (0, 1), got {self.budget_share}")


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


def private_selection(
    grid: Sequence[Mapping[str, Any]],
    run_candidate: Callable[[Mapping[str, Any], int], float],
    selection: SelectionConfig,
    rng: np.random.Generator,
) -> Selection:
    """Draw K, run K candidates (grid point uniform at random), keep the highest score
    (:func:`dpfit.selection.select_best`).

    ``run_candidate(point, i)`` trains candidate i with ``point`` at the plan's candidate
    noise and returns a score computed from its released model on public data only (e.g.
    accuracy on the server's validation split). Ties keep the earlier run.
    """
    best = select_best(grid, lambda point, i: (run_candidate(point, i), None), selection, rng)
    return Selection(best.choice, best.score, best.runs)

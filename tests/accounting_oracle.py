"""dp-accounting called directly, with the neighbouring relation spelled out: the independent
computation every epsilon dpfit reports is checked against (never through dpfit.accounting)."""

from __future__ import annotations

import dp_accounting
from dp_accounting import pld

REPLACE = dp_accounting.NeighboringRelation.REPLACE_ONE
ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


def direct_epsilon(sigma: float, q: float, steps: int, delta: float, relation, kind="pld"):
    """dp-accounting alone: `steps` Poisson-sampled Gaussian steps (q = 1: unsampled)."""
    if kind == "pld":
        acc = pld.PLDAccountant(relation, value_discretization_interval=1e-4)
    else:
        acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    gauss = dp_accounting.GaussianDpEvent(sigma)
    step = gauss if q == 1 else dp_accounting.PoissonSampledDpEvent(q, gauss)
    acc.compose(dp_accounting.SelfComposedDpEvent(step, steps))
    return acc.get_epsilon(delta)


def selected_then_trained_epsilon(
    q: float, rounds: int, z_candidate: float, mean_runs: float, shape: float, z_final: float,
    delta: float,
) -> float:  # fmt: skip
    """Private selection (Papernot & Steinke: K candidate runs of `rounds` sampled Gaussians
    at z_candidate, dp-accounting's RepeatAndSelect under RDP), then the final run at z_final."""

    def run(z: float):
        step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
        return dp_accounting.SelfComposedDpEvent(step, rounds)

    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.dp_event.RepeatAndSelectDpEvent(run(z_candidate), mean_runs, shape))
    acc.compose(run(z_final))
    return acc.get_epsilon(delta)


def selected_epsilon(
    q: float, steps: int, z: float, score_sigma: float, mean_runs: float, shape: float,
    delta: float,
) -> float:  # fmt: skip
    """A private selection whose candidate is `steps` sampled Gaussians at z, then a Gaussian
    score (sensitivity 1, std score_sigma), repeated and selected (Papernot & Steinke, RDP);
    the selected candidate's output is the release, nothing composed after it."""
    step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    candidate = dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(step, steps), dp_accounting.GaussianDpEvent(score_sigma)]
    )
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.dp_event.RepeatAndSelectDpEvent(candidate, mean_runs, shape))
    return acc.get_epsilon(delta)

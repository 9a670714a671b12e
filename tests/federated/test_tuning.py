"""Private hyperparameter selection: the number of runs, its bound, and the budget it takes."""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting import rdp
from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS, compute_epsilon

from dpfit.federated.accounting import BudgetExhausted
from dpfit.federated.strategy import DPFedAvgServer, ServerConfig
from dpfit.federated.tuning import (
    SelectionConfig,
    TuningError,
    check_grid,
    draw_runs,
    plan_tuning,
    private_selection,
    selection_event,
    tnb_gamma,
    tnb_mean,
)

DELTA = 1e-5
# small enough that a calibration takes a second or two
CFG = ServerConfig(method="fixed", num_clients=100, clients_per_round=10, rounds=4)
GRID = [{"initial_clip": c} for c in (0.3, 1.0, 3.0)]


def _epsilon(*events: dpa.DpEvent) -> float:
    acc = rdp.RdpAccountant()
    for e in events:
        acc.compose(e)
    return acc.get_epsilon(DELTA)


def _run(q: float, rounds: int, z: float) -> dpa.DpEvent:
    """One fixed-clip run, written out directly (not through dpfit)."""
    return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), rounds)


# --------------------------------------------------------------------------------------------
# K: Papernot & Steinke, Definition 1
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 3.0])
def test_gamma_gives_the_requested_mean(shape):
    gamma = tnb_gamma(4.0, shape)
    assert 0 < gamma < 1
    assert tnb_mean(gamma, shape) == pytest.approx(4.0, rel=1e-9)


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 3.0, math.inf])
def test_draws_follow_the_distribution_the_bound_assumes(shape):
    """Empirical mean and P[K = 1] against Definition 1 (Poisson: e^-mu mu)."""
    sel = SelectionConfig(mean_runs=3.0, shape=shape)
    rng = np.random.default_rng(7)
    ks = np.array([draw_runs(sel, rng) for _ in range(6_000)])
    se = ks.std() / math.sqrt(len(ks))
    assert abs(ks.mean() - 3.0) < 5 * se
    if math.isinf(shape):
        p1 = 3.0 * math.exp(-3.0)
        assert ks.min() >= 0
    else:
        assert ks.min() >= 1  # a truncated negative binomial always runs a candidate
        g = tnb_gamma(3.0, shape)
        # P[K=1] = (1-gamma) eta / (gamma^-eta - 1); eta -> 0: (1-gamma) / log(1/gamma)
        p1 = (1 - g) / math.log(1 / g) if shape == 0 else (1 - g) * shape / (g**-shape - 1)
    freq = float(np.mean(ks == 1))
    assert abs(freq - p1) < 5 * math.sqrt(p1 * (1 - p1) / len(ks))


# --------------------------------------------------------------------------------------------
# The bound: Theorem 2 written out by hand for a Gaussian candidate
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,mean", [(1.0, 3.0), (0.0, 5.0), (2.0, 2.0)])
def test_selection_event_is_theorem_2(shape, mean):
    """A Gaussian with multiplier s is (lambda, lambda / 2s^2)-RDP; Theorem 2 then gives
    eps'(l) = eps(l) + (1+eta) min_lh [(1 - 1/lh) eps(lh) + log(1/gamma)/lh] + log E[K]/(l-1),
    with lambda_hat over the accountant's orders and RDP's monotonicity in the order."""
    s = 4.0
    orders = np.array(DEFAULT_RDP_ORDERS, dtype=float)
    eps = orders / (2 * s**2)
    gamma = tnb_gamma(mean, shape)
    c = (1 + shape) * np.min((1 - 1 / orders) * eps + math.log(1 / gamma) / orders)
    bound = eps + c + math.log(mean) / (orders - 1)
    bound = np.minimum.accumulate(bound[::-1])[::-1]  # RDP grows with the order
    by_hand, _ = compute_epsilon(orders, bound, DELTA)
    event = selection_event(dpa.GaussianDpEvent(s), mean, shape)
    assert _epsilon(event) == pytest.approx(by_hand, rel=1e-6)
    assert _epsilon(event) > _epsilon(dpa.GaussianDpEvent(s))  # selection is not free


# --------------------------------------------------------------------------------------------
# The budget split: tuning share + final training compose to the target
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan():
    return plan_tuning(replace(CFG, target_epsilon=4.0), GRID, SelectionConfig(3.0, 1.0, 1 / 3))


@pytest.fixture(scope="module")
def tuned_server(plan):
    """The final run's server, calibrated once (copy its accountant before recording)."""
    return DPFedAvgServer(plan.final, [np.zeros(3, np.float32)])


def test_tuning_spends_its_share(plan):
    q, t = CFG.sample_rate, CFG.rounds
    direct = _epsilon(
        dpa.dp_event.RepeatAndSelectDpEvent(_run(q, t, plan.candidate_noise_multiplier), 3.0, 1.0)
    )
    assert direct == pytest.approx(4.0 / 3, rel=1e-3)
    assert plan.tuning_epsilon == pytest.approx(direct, rel=1e-9)
    assert plan.candidate.noise_multiplier == plan.candidate_noise_multiplier
    assert plan.candidate.target_epsilon is None


def test_reported_epsilon_includes_the_tuning(plan, tuned_server):
    """The final run's ledger = selection + its rounds, composed directly by dp-accounting;
    it meets the whole target, and the same run without the selection would spend less."""
    z = tuned_server.noise_multiplier
    ledger = copy.deepcopy(tuned_server.accountant)
    for _ in range(CFG.rounds):
        ledger.check_round(tuned_server.round_multipliers)
        ledger.record_round(tuned_server.round_multipliers)
    q, t = CFG.sample_rate, CFG.rounds
    tuning = dpa.dp_event.RepeatAndSelectDpEvent(
        _run(q, t, plan.candidate_noise_multiplier), 3.0, 1.0
    )
    direct = _epsilon(tuning, _run(q, t, z))
    assert ledger.epsilon() == pytest.approx(direct, rel=1e-9)
    assert direct == pytest.approx(4.0, rel=1e-3)
    assert direct <= 4.0 * (1 + 1e-6)
    assert _epsilon(_run(q, t, z)) < 4.0 - 0.5  # the training alone leaves room for tuning


def test_tuned_run_stops_at_the_whole_target(tuned_server):
    """One round more than planned would pass the target, tuning included."""
    ledger = copy.deepcopy(tuned_server.accountant)
    assert ledger.epsilon() == pytest.approx(4.0 / 3, rel=1e-3)  # before any round
    for _ in range(CFG.rounds):
        ledger.record_round(tuned_server.round_multipliers)
    with pytest.raises(BudgetExhausted):
        ledger.check_round(tuned_server.round_multipliers)


def test_checkpoint_of_an_untuned_run_is_not_resumed_as_tuned(plan, tmp_path):
    from dpfit.federated.strategy import CheckpointMismatch

    fixed_z = {"target_epsilon": None, "noise_multiplier": 1.0}
    DPFedAvgServer(replace(CFG, **fixed_z), [np.zeros(3, np.float32)]).save_checkpoint(tmp_path)
    tuned = DPFedAvgServer(replace(plan.final, **fixed_z), [np.zeros(3, np.float32)])
    with pytest.raises(CheckpointMismatch):
        tuned.load_checkpoint(tmp_path)


# --------------------------------------------------------------------------------------------
# What the selection refuses, and what it returns
# --------------------------------------------------------------------------------------------


def test_grid_that_changes_the_noise_is_refused():
    dyn = replace(CFG, method="dynamic", target_epsilon=4.0)
    check_grid(dyn, [{"clip_decay": r} for r in (0.3, 0.5, 0.8)])  # same noise: accepted
    with pytest.raises(TuningError, match="changes the noise"):
        check_grid(dyn, [{"noise_decay": r} for r in (0.3, 0.8)])


def test_plan_refuses_pld_and_a_fixed_multiplier():
    with pytest.raises(TuningError, match="rdp"):
        plan_tuning(replace(CFG, target_epsilon=4.0, accountant="pld"), GRID)
    with pytest.raises(TuningError, match="target_epsilon"):
        plan_tuning(replace(CFG, target_epsilon=None, noise_multiplier=1.0), GRID)
    with pytest.raises(ValueError, match="rdp"):
        replace(CFG, tuning_noise_multiplier=2.0, accountant="pld")


def test_selection_keeps_the_best_scored_draw():
    grid = [{"a": 0}, {"a": 1}, {"a": 2}]
    seen = []

    def run(point, i):
        seen.append(point["a"])
        return math.nan if point["a"] == 2 else float(point["a"])

    sel = SelectionConfig(mean_runs=6.0, shape=1.0)
    out = private_selection(grid, run, sel, np.random.default_rng(3))
    assert out.runs == len(seen) >= 1
    finite = [a for a in seen if a != 2]
    if finite:
        assert out.choice == {"a": max(finite)} and out.score == max(finite)
    else:  # only diverged runs: the first one, scored -inf
        assert out.choice == {"a": 2} and out.score == -math.inf


def test_poisson_selection_may_run_nothing():
    sel = SelectionConfig(mean_runs=1.0, shape=math.inf)
    outs = [
        private_selection([{"a": 0}], lambda p, i: 1.0, sel, np.random.default_rng(s))
        for s in range(30)
    ]
    assert any(o.choice is None and o.runs == 0 for o in outs)
    assert any(o.choice == {"a": 0} for o in outs)

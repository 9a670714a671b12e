"""The accountant against direct dp-accounting compositions."""

from __future__ import annotations

import math

import dp_accounting as dpa
import pytest
from dp_accounting import pld, rdp

from dpfit.federated.accounting import (
    BudgetExhausted,
    CalibrationError,
    ClientLevelAccountant,
    calibrate_noise_multiplier,
    epsilon_of,
    training_event,
)
from dpfit.federated.clipping import (
    ClacClip,
    ClipConfig,
    DynamicClip,
    QuantileClip,
    RoundObservation,
)


def _direct(event, kind):
    acc = rdp.RdpAccountant() if kind == "rdp" else pld.PLDAccountant()
    acc.compose(event)
    return acc.get_epsilon(1e-5)


@pytest.mark.parametrize("kind,expected", [("rdp", 5.388), ("pld", 4.786)])
def test_vote_plus_rounds_matches_direct_composition(kind, expected):
    n, m, t, z, sigma_h = 1000, 50, 200, 1.0, 10.0
    direct = dpa.ComposedDpEvent(
        [
            dpa.GaussianDpEvent(sigma_h),
            dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(m / n, dpa.GaussianDpEvent(z)), t),
        ]
    )
    acc = ClientLevelAccountant(num_clients=n, expected_clients=m, delta=1e-5, kind=kind)
    acc.record_one_off(sigma_h)
    for _ in range(t):
        acc.record_round((z,))
    eps = acc.epsilon()
    assert eps == pytest.approx(_direct(direct, kind), rel=1e-9)
    assert eps == pytest.approx(expected, abs=2e-3)


def test_auxiliary_releases_compose_inside_the_sampling():
    """Quantile's (update, count) pair costs exactly the combined z (Theorem 1), under RDP."""
    cfg = ClipConfig(noise_multiplier=1.3, count_noise_std=4.0)
    mults = QuantileClip.round_multipliers(cfg)
    q = 0.05
    composed = dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(q, dpa.ComposedDpEvent([dpa.GaussianDpEvent(x) for x in mults])),
        100,
    )
    single = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(1.3)), 100)
    acc = ClientLevelAccountant(num_clients=200, expected_clients=10, delta=1e-5)
    for _ in range(100):
        acc.record_round(mults)
    assert acc.epsilon() == pytest.approx(_direct(composed, "rdp"), rel=1e-9)
    assert acc.epsilon() == pytest.approx(_direct(single, "rdp"), rel=1e-3)
    # CLAC's loss release likewise
    acc2 = ClientLevelAccountant(num_clients=200, expected_clients=10, delta=1e-5, kind="pld")
    for _ in range(100):
        acc2.record_round(ClacClip.round_multipliers(ClipConfig(noise_multiplier=1.3)))
    assert acc2.epsilon() == pytest.approx(_direct(single, "pld"), rel=1e-6)


@pytest.mark.parametrize("one_offs", [(), (10.0,)])
def test_calibration_meets_target_for_every_method(one_offs):
    target, q, t = 4.0, 0.25, 8
    z = calibrate_noise_multiplier(target, 1e-5, q, t, one_offs)
    eps = epsilon_of(training_event(q, t, (z,), one_offs), 1e-5)
    assert eps <= target * (1 + 1e-6)
    assert eps == pytest.approx(target, rel=1e-2)
    # the same z gives the same epsilon whichever way a rule splits it
    for cls in (QuantileClip, ClacClip):
        mults = cls.round_multipliers(ClipConfig(noise_multiplier=z))
        eps_split = epsilon_of(training_event(q, t, mults, one_offs), 1e-5)
        assert eps_split == pytest.approx(eps, rel=1e-3)


def test_calibration_rejects_vote_that_spends_everything():
    with pytest.raises(CalibrationError, match="vote noise"):
        calibrate_noise_multiplier(0.5, 1e-5, 0.1, 10, (0.5,))


def test_budget_stop_before_a_round_would_exceed():
    q, t = 0.1, 5
    z = calibrate_noise_multiplier(2.0, 1e-5, q, t)
    acc = ClientLevelAccountant(
        num_clients=100, expected_clients=10, delta=1e-5, target_epsilon=2.0
    )
    for _ in range(t):
        acc.check_round((z,))
        acc.record_round((z,))
    with pytest.raises(BudgetExhausted, match="would bring client-level epsilon"):
        acc.check_round((z,))
    assert len(acc.rounds) == t  # the refused round was not recorded


def test_no_noise_is_infinite_epsilon_and_state_roundtrip():
    acc = ClientLevelAccountant(num_clients=10, expected_clients=2, delta=1e-5)
    acc.record_round((0.0,))
    assert math.isinf(acc.epsilon())
    acc2 = ClientLevelAccountant(num_clients=10, expected_clients=2, delta=1e-5)
    acc2.record_one_off(5.0)
    acc2.record_round((1.0, 3.0))
    clone = ClientLevelAccountant(num_clients=10, expected_clients=2, delta=1e-5)
    clone.load_state_dict(acc2.state_dict())
    assert clone.epsilon() == acc2.epsilon()


def _dynamic_cfg(z: float, t_total: int, rho: float = 0.5) -> ClipConfig:
    return ClipConfig(noise_multiplier=z, total_rounds=t_total, noise_decay=rho)


def test_dynamic_schedule_is_accounted_round_by_round():
    """Du et al.'s decaying noise: the ledger holds each round's own z_t = z_0 rho^(t/T) and
    its epsilon equals dp-accounting's direct composition of those rounds."""
    q, t_total, z0, rho = 0.1, 4, 1.2, 0.5
    zs = [z0 * rho ** (t / t_total) for t in range(t_total)]
    acc = ClientLevelAccountant(
        num_clients=100, expected_clients=10, delta=1e-5, target_epsilon=100.0
    )
    rule = DynamicClip(_dynamic_cfg(z0, t_total, rho))
    for _ in range(t_total):
        acc.check_round(rule.current_multipliers())
        acc.record_round(rule.current_multipliers())
        rule.observe(RoundObservation(), None)
    assert [r[0] for r in acc.rounds] == pytest.approx(zs)
    direct = dpa.ComposedDpEvent([dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)) for z in zs])
    assert acc.epsilon() == pytest.approx(_direct(direct, "rdp"), rel=1e-9)
    # accounting every round at z_0 would under-report what the decayed rounds spent
    assert epsilon_of(training_event(q, t_total, (z0,)), 1e-5) < 0.9 * acc.epsilon()


def test_dynamic_calibration_meets_the_target_with_the_whole_schedule():
    q, t_total, target = 0.1, 3, 4.0
    z0 = calibrate_noise_multiplier(
        target,
        1e-5,
        q,
        t_total,
        schedule=lambda z: DynamicClip.schedule(_dynamic_cfg(z, t_total), t_total),
    )
    zs = [z0 * 0.5 ** (t / t_total) for t in range(t_total)]
    direct = dpa.ComposedDpEvent([dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)) for z in zs])
    eps = _direct(direct, "rdp")
    assert eps <= target * (1 + 1e-6)
    assert eps == pytest.approx(target, rel=1e-2)


@pytest.mark.parametrize("shared_one_offs,votes", [(1, 1), (0, 3)])
def test_all_continuations_compose_shared_releases_once_and_own_ones_per_fork(
    shared_one_offs, votes
):
    """Five rounds, two on the checkpoint; three continuations. A vote on the checkpoint is
    shared (counted once); a vote the continuation made itself counts once per continuation."""
    acct = ClientLevelAccountant(num_clients=100, expected_clients=10, delta=1e-5)
    acct.record_one_off(4.0)
    for _ in range(5):
        acct.record_round((1.0,))
    got = acct.epsilon_if_all_continuations_released(2, shared_one_offs, 3)
    direct = dpa.ComposedDpEvent(
        [dpa.GaussianDpEvent(4.0)] * votes
        + [dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), 11)]
    )
    assert got == pytest.approx(_direct(direct, "rdp"), rel=1e-9)
    assert acct.epsilon_if_all_continuations_released(5, 1, 3) == pytest.approx(acct.epsilon())
    acct.record_round((0.0,))  # a non-private round: nothing to promise
    assert acct.epsilon_if_all_continuations_released(2, 1, 2) == math.inf

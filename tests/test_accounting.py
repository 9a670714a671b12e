"""Epsilon checked against an independent implementation (Opacus's RDP analysis)."""

from __future__ import annotations

import math

import dp_accounting
import pytest

from dpfit.accounting import PrivacyLedger, StepRecord, epsilon_for, noise_multiplier_for

opacus_rdp = pytest.importorskip("opacus.accountants.analysis.rdp")

ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + [128, 256, 512]


def opacus_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=ORDERS)
    eps, _ = opacus_rdp.get_privacy_spent(orders=ORDERS, rdp=rdp, delta=delta)
    return float(eps)


@pytest.mark.parametrize(
    "q,sigma,steps,published",
    [(0.01, 4.0, 10_000, 1.035), (256 / 60_000, 1.1, 14_062, 2.597)],
)
def test_rdp_epsilon_matches_opacus(q, sigma, steps, published):
    ours = epsilon_for(sigma, q, steps, 1e-5)
    theirs = opacus_epsilon(q, sigma, steps, 1e-5)
    assert ours == pytest.approx(theirs, rel=0.02)
    assert ours == pytest.approx(published, rel=0.02)


@pytest.mark.parametrize("q,sigma,steps", [(0.001, 0.8, 3000), (0.05, 1.5, 200), (0.2, 3.0, 50)])
def test_rdp_epsilon_matches_opacus_across_regimes(q, sigma, steps):
    assert epsilon_for(sigma, q, steps, 1e-6) == pytest.approx(
        opacus_epsilon(q, sigma, steps, 1e-6), rel=0.02
    )


def test_pld_is_tighter_than_rdp_and_close():
    rdp = epsilon_for(1.0, 0.01, 1000, 1e-5, "rdp")
    pld = epsilon_for(1.0, 0.01, 1000, 1e-5, "pld")
    assert pld < rdp
    assert pld > 0.7 * rdp


def test_calibration_meets_target_tightly():
    sigma = noise_multiplier_for(8.0, 1e-5, 0.01, 1000)
    eps = epsilon_for(sigma, 0.01, 1000, 1e-5)
    assert eps <= 8.0
    assert eps > 7.9
    assert epsilon_for(sigma * 0.98, 0.01, 1000, 1e-5) > 8.0  # not over-noised


def test_ledger_composes_phases_like_one_event():
    ledger = PrivacyLedger(1e-5)
    for _ in range(30):
        ledger.record(1.0, 0.02)
    for _ in range(20):
        ledger.record(2.0, 0.05)
    assert ledger.steps == 50
    assert [r.count for r in ledger.records] == [30, 20]
    direct = dp_accounting.rdp.RdpAccountant()
    direct.compose(
        dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.0)), 30
    )
    direct.compose(
        dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(2.0)), 20
    )
    assert ledger.epsilon() == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)
    again = PrivacyLedger.from_state_dict(ledger.state_dict())
    assert again.epsilon() == ledger.epsilon()


def test_calibration_with_an_earlier_phase_meets_the_total():
    earlier = StepRecord(1.0, 0.02, 100).event()
    sigma = noise_multiplier_for(6.0, 1e-5, 0.02, 200, extra_events=(earlier,))
    ledger = PrivacyLedger(1e-5, records=[StepRecord(1.0, 0.02, 100), StepRecord(sigma, 0.02, 200)])
    assert 5.9 < ledger.epsilon() <= 6.0


def test_zero_noise_is_infinite_epsilon():
    assert math.isinf(epsilon_for(0.0, 0.1, 10, 1e-5))
    assert epsilon_for(1.0, 0.1, 0, 1e-5) == 0.0

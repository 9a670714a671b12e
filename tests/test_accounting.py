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


# ------------------------------------------------------------------ calibration grid


def independent_epsilon(sigma: float, q: float, steps: int, delta: float, kind: str) -> float:
    """dp-accounting used directly (no dpfit code): Poisson-subsampled Gaussian, `steps` times."""
    if kind == "rdp":
        acc = dp_accounting.rdp.RdpAccountant()
    else:
        acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


GRID = [
    # (accountant, q, steps, eps): q = 256/784 with 3 epochs is `dpfit train`'s bundled-size job
    ("rdp", 256 / 784, 9, 8.0),
    ("rdp", 0.01, 1000, 2.0),
    ("rdp", 0.05, 100, 4.0),
    ("rdp", 0.002, 3000, 0.5),
    ("pld", 256 / 784, 9, 8.0),
    ("pld", 0.05, 40, 3.0),
]


@pytest.mark.parametrize("kind,q,steps,eps", GRID)
def test_calibrated_sigma_meets_the_target_tightly(kind, q, steps, eps, monkeypatch):
    import dpfit.accounting as acc

    probed = []  # PLD evaluations: the old search probed sigma = 1e-3 (a 38 GiB array)
    real = acc.epsilon_of

    def spy(event, delta, accountant="rdp", *args):
        if accountant == "pld":
            probed.append(event.events[-1].event.event.noise_multiplier)
        return real(event, delta, accountant, *args)

    monkeypatch.setattr(acc, "epsilon_of", spy)
    delta = 1e-5
    sigma = noise_multiplier_for(eps, delta, q, steps, kind)
    assert independent_epsilon(sigma, q, steps, delta, kind) <= eps
    # tight: 0.5% less noise (well above the calibration tolerance of 1e-3) breaks the target
    assert independent_epsilon(sigma * 0.995, q, steps, delta, kind) > eps
    if kind == "pld":
        assert probed and min(probed) >= 0.4 * sigma


def test_accountant_failure_is_a_dpfit_error(monkeypatch):
    import dpfit.accounting as acc
    from dpfit.errors import AccountingError

    class Exploding:
        def compose(self, event):
            raise MemoryError("Unable to allocate 38.0 GiB")

    real = acc.make_accountant
    monkeypatch.setattr(
        acc, "make_accountant", lambda kind, *a: Exploding() if kind == "pld" else real(kind, *a)
    )
    with pytest.raises(AccountingError, match="RDP accountant, or more noise"):
        acc.epsilon_for(0.5, 0.3, 9, 1e-5, "pld")
    with pytest.raises(AccountingError):
        acc.noise_multiplier_for(8.0, 1e-5, 0.3, 9, "pld")


def test_pld_budget_step_limit_is_exact_on_the_reporting_grid():
    """The engine searches the step limit on PLD's coarse grid, then settles on the fine one:
    the limit k has epsilon(k) <= target < epsilon(k + 1) under dp-accounting directly."""
    from torch import nn

    import dpfit

    q, sigma, target = 0.1, 2.0, 1.5
    engine = dpfit.PrivacyEngine(
        nn.Linear(2, 2), expected_batch_size=10, sample_size=100, noise_multiplier=sigma,
        target_epsilon=target, steps=20, accountant="pld",
    )  # fmt: skip
    k = engine._max_steps
    assert k is not None and k > 0
    assert independent_epsilon(sigma, q, k, 1e-5, "pld") <= target
    assert independent_epsilon(sigma, q, k + 1, 1e-5, "pld") > target


def test_ledger_prefix_is_the_ledger_as_it_stood_after_k_steps():
    """Per-step reports (steps.csv) take the epsilon after each step from the step count."""
    ledger = PrivacyLedger(1e-5)
    for sigma, count in ((1.0, 3), (2.0, 4)):
        for _ in range(count):
            ledger.record(sigma, 0.05)
    for k in (0, 2, 3, 5, 7):
        acc = dp_accounting.rdp.RdpAccountant()
        events = [(1.0, min(k, 3)), (2.0, max(0, k - 3))]
        for sigma, n in events:
            if n:
                acc.compose(
                    dp_accounting.SelfComposedDpEvent(
                        dp_accounting.PoissonSampledDpEvent(
                            0.05, dp_accounting.GaussianDpEvent(sigma)
                        ),
                        n,
                    )
                )
        want = acc.get_epsilon(1e-5) if k else 0.0
        assert ledger.prefix(k).steps == k
        assert ledger.prefix(k).epsilon() == pytest.approx(want)
    with pytest.raises(ValueError, match="steps must be in"):
        ledger.prefix(8)


# ------------------------------------------------------------------ cached one-step results


def from_scratch(phases, steps, delta, kind, relation):
    """dp-accounting alone, composing the first `steps` steps of `phases` [(sigma, q, count)]."""
    rel = dp_accounting.NeighboringRelation
    relation = rel.REPLACE_ONE if relation == "replace-one" else rel.ADD_OR_REMOVE_ONE
    if kind == "rdp":
        acc = dp_accounting.rdp.RdpAccountant(neighboring_relation=relation)
    else:
        acc = dp_accounting.pld.PLDAccountant(relation, value_discretization_interval=1e-4)
    for sigma, q, count in phases:
        n = min(count, steps)
        steps -= n
        if n:
            step = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
            acc.compose(dp_accounting.SelfComposedDpEvent(step, n))
    return acc.get_epsilon(delta)


CACHED_GRID = [
    # (accountant, relation, phases [(sigma, q, count)], delta): one and two phases, the
    # bundled job's q (1012 / 10233) among them
    ("rdp", "add-remove", [(0.9, 1012 / 10233, 30), (0.9, 1012 / 10233, 30)], 1e-5),
    ("rdp", "add-remove", [(0.7, 0.3, 4), (1.4, 0.05, 40)], 1e-5),
    ("rdp", "add-remove", [(3.0, 0.01, 200)], 1e-7),
    ("rdp", "add-remove", [(1.1, 256 / 60_000, 500), (0.8, 0.02, 25)], 1e-6),
    ("pld", "add-remove", [(2.0, 0.05, 6), (1.5, 0.1, 4)], 1e-5),
    ("pld", "replace-one", [(3.0, 0.1, 3), (2.0, 0.02, 5)], 1e-6),
]


@pytest.mark.parametrize("kind,relation,phases,delta", CACHED_GRID)
def test_ledger_epsilon_after_every_step_is_dp_accountings_own(kind, relation, phases, delta):
    """The ledger composes cached one-step results: its epsilon after the first steps, across
    the phase switch and at the end (where the cache is warm) and at another delta is what
    dp-accounting computes from scratch."""
    ledger = PrivacyLedger(delta, kind, neighbouring=relation)
    for sigma, q, count in phases:
        for _ in range(count):
            ledger.record(sigma, q)
    total, first = ledger.steps, phases[0][2]
    for k in sorted({1, 2, first, first + 1, total} & set(range(1, total + 1))):
        assert ledger.prefix(k).epsilon() == pytest.approx(
            from_scratch(phases, k, delta, kind, relation), rel=1e-9, abs=0
        )
    assert ledger.epsilon(delta * 10) == pytest.approx(
        from_scratch(phases, total, delta * 10, kind, relation), rel=1e-9, abs=0
    )


def test_one_step_results_are_built_once_per_mechanism(monkeypatch):
    """What makes a per-step epsilon cheap: each mechanism's one-step RDP curve is computed
    once, not once per step."""
    import dpfit.accounting as acc

    built = []
    real = acc.make_accountant
    monkeypatch.setattr(acc, "make_accountant", lambda *a, **k: built.append(a) or real(*a, **k))
    acc._one_step_rdp.cache_clear()
    ledger = PrivacyLedger(1e-5)
    for sigma in (0.83, 0.83, 0.83, 1.7, 1.7):
        ledger.record(sigma, 0.0731)
        ledger.epsilon()
    assert len(built) == 2

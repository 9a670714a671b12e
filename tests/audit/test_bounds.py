"""The one-run bound's arithmetic, checked against examples worked by hand from the formula."""

from __future__ import annotations

import math

import pytest

from dpfit.audit.bounds import (
    AuditError,
    best_bound,
    default_splits,
    epsilon_lower_bound,
    guess_top_bottom,
    p_value,
    score_guesses,
)


def test_all_correct_pure_dp_by_hand():
    """m = r = v = 10, delta = 0. Under eps-DP each guess is right w.p. at most
    p = 1/(1 + e^-eps), so P[10 of 10] = p^10. The bound solves p^10 = 0.05:
    p = 0.05^(1/10) = e^(-0.2995732) = 0.7411344, eps = ln(p/(1-p)) = ln(0.7411344/0.2588656)
    = ln(2.8630032) = 1.0518732."""
    assert epsilon_lower_bound(10, 10, 10, 0.0, 0.95) == pytest.approx(1.0518732, abs=1e-5)
    p = 1 / (1 + math.exp(-1.0518732))
    assert p_value(10, 10, 10, 1.0518732, 0.0) == pytest.approx(p**10, rel=1e-9)


def test_delta_term_by_hand():
    """m = 100, r = 4, v = 3, eps = ln 3 (so p = 3/4), delta = 1e-3.
    Tail: P[Bin(4, 3/4) >= 3] = 4 (3/4)^3 (1/4) + (3/4)^4 = 0.421875 + 0.31640625 = 0.73828125.
    pmf(2) = 6 (9/16)(1/16) = 0.2109375, pmf(1) = 4 (3/4)(1/64) = 0.046875, pmf(0) = 1/256.
    max_i P[3-i <= Bin < 3] / i: i=1: 0.2109375; i=2: 0.2578125/2; i=3: 0.26171875/3 -> 0.2109375.
    p-value = 0.73828125 + 2 * 100 * 1e-3 * 0.2109375 = 0.78046875."""
    assert p_value(100, 4, 3, math.log(3), 1e-3) == pytest.approx(0.78046875, rel=1e-12)
    assert p_value(100, 4, 3, math.log(3), 0.0) == pytest.approx(0.73828125, rel=1e-12)


def test_bound_properties():
    # no better than chance: no bound; more correct guesses: a higher bound; delta costs
    assert epsilon_lower_bound(1000, 100, 50, 1e-5) == 0.0
    b = [epsilon_lower_bound(1000, 100, v, 1e-5) for v in (80, 90, 100)]
    assert 0 < b[0] < b[1] < b[2]
    assert epsilon_lower_bound(1000, 100, 100, 1e-3) < epsilon_lower_bound(1000, 100, 100, 0.0)
    # the bound is where the p-value crosses 1 - confidence
    eps = epsilon_lower_bound(1000, 200, 190, 1e-5)
    assert (
        p_value(1000, 200, 190, eps - 1e-3, 1e-5)
        < 0.05
        <= p_value(1000, 200, 190, eps + 1e-3, 1e-5)
    )
    # a higher confidence gives a lower bound
    assert epsilon_lower_bound(1000, 200, 190, 1e-5, 0.99) < eps


def test_guesses_and_bonferroni():
    scores = [0.1, 5.0, -3.0, 2.0, 0.0, -1.0]
    assert guess_top_bottom(scores, 2, 1) == [0, 1, -1, 1, 0, 0]
    g = score_guesses([0, 1, -1, 1, 0, 0], [True, True, False, False, True, False])
    assert (g.made, g.correct) == (3, 2)
    inc = [i % 2 == 0 for i in range(400)]
    perfect = [1.0 if x else 0.0 for x in inc]
    one = best_bound(perfect, inc, [(200, 200)], 0.0)
    many = best_bound(perfect, inc, default_splits(400), 0.0)
    assert one.correct == one.guesses == 400
    assert many.epsilon_lower_bound < one.epsilon_lower_bound  # the split costs confidence
    assert one.epsilon_lower_bound == pytest.approx(epsilon_lower_bound(400, 400, 400, 0.0))
    assert one.ceiling == one.epsilon_lower_bound  # every guess right: at the ceiling
    assert many.ceiling == many.epsilon_lower_bound
    noisy = perfect[:]
    noisy[0], noisy[1] = 0.0, 1.0  # one canary in scored as out and one out scored as in
    worse = best_bound(noisy, inc, default_splits(400), 0.0)
    assert worse.epsilon_lower_bound < worse.ceiling == many.ceiling


def test_bad_counts_are_errors():
    with pytest.raises(AuditError):
        p_value(10, 5, 6, 1.0, 0.0)
    with pytest.raises(AuditError):
        epsilon_lower_bound(10, 5, 5, 0.0, confidence=1.0)
    with pytest.raises(AuditError):
        guess_top_bottom([1.0, 2.0], 2, 1)

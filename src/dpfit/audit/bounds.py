"""The one-run lower bound on epsilon (Steinke, Nasr and Jagielski 2023, Theorem 5.2 / App. D).

m canaries are each included with probability 1/2 independently; an auditor guesses in/out
for r of them and is right v times. If the training run is (eps, delta)-DP, then

    P[v correct or more] <= P[Binomial(r, p) >= v] + 2 m delta * max_{1<=i<=v} P[v-i <= Binomial(r, p) < v] / i,

with p = e^eps / (1 + e^eps) (the accuracy of eps-randomised response). The empirical lower
bound at confidence c is the largest eps whose p-value is still below 1 - c: the run is not
(eps, delta)-DP for any smaller eps, unless an event of probability 1 - c happened.

Binomial terms are computed exactly (scipy's binomial, float64), nothing is approximated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from scipy import stats

from dpfit.errors import DPFitError


class AuditError(DPFitError):
    """An audit was asked for something it cannot compute (bad counts, confidence, sizes)."""


def _check(m: int, r: int, v: int, delta: float) -> None:
    if not (0 <= v <= r <= m):
        raise AuditError(f"need 0 <= correct <= guesses <= canaries, got v={v}, r={r}, m={m}")
    if not 0 <= delta < 1:
        raise AuditError(f"delta must be in [0, 1), got {delta}")


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Probability of >= v correct out of r guesses among m canaries if the run is (eps, delta)-DP."""
    _check(m, r, v, delta)
    if epsilon < 0:
        raise AuditError(f"epsilon must be >= 0, got {epsilon}")
    p = 1.0 / (1.0 + math.exp(-epsilon))
    tail = float(stats.binom.sf(v - 1, r, p))  # P[Bin(r, p) >= v]
    if delta == 0 or v == 0:
        return min(1.0, tail)
    # max over i of P[v - i <= Bin < v] / i, one pmf sum (cumulative in i)
    pmf = stats.binom.pmf(range(v - 1, -1, -1), r, p)  # pmf(v-1), pmf(v-2), ..., pmf(0)
    best = 0.0
    acc = 0.0
    for i, mass in enumerate(pmf, start=1):
        acc += float(mass)
        best = max(best, acc / i)
    return min(1.0, tail + 2.0 * m * delta * best)


def epsilon_lower_bound(
    m: int, r: int, v: int, delta: float, confidence: float = 0.95, tol: float = 1e-6
) -> float:
    """Largest eps that the outcome (v correct of r guesses, m canaries) rejects at `confidence`.

    0 when even eps = 0 is not rejected. The p-value rises with eps (a less private run makes
    many correct guesses more likely), so bisect for the eps where it crosses 1 - confidence.
    """
    _check(m, r, v, delta)
    if not 0 < confidence < 1:
        raise AuditError(f"confidence must be in (0, 1), got {confidence}")
    alpha = 1.0 - confidence
    if p_value(m, r, v, 0.0, delta) >= alpha:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) < alpha:
        lo, hi = hi, 2 * hi
        if hi > 1e3:  # only reached with delta=0 and r=v huge; report the search limit
            return lo
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p_value(m, r, v, mid, delta) < alpha else (lo, mid)
    return lo


@dataclass(frozen=True)
class Guesses:
    """The auditor's guesses: +1 (included), -1 (excluded), 0 (abstain), and how many were right."""

    guess: tuple[int, ...]
    made: int
    correct: int


def guess_top_bottom(scores: Sequence[float], k_plus: int, k_minus: int) -> list[int]:
    """+1 for the k_plus highest scores, -1 for the k_minus lowest, 0 (abstain) for the rest."""
    m = len(scores)
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
        raise AuditError(f"need k+ + k- <= {m} canaries, got {k_plus} + {k_minus}")
    order = sorted(range(m), key=lambda i: (scores[i], i))
    g = [0] * m
    for i in order[:k_minus]:
        g[i] = -1
    for i in order[m - k_plus :] if k_plus else []:
        g[i] = 1
    return g


def score_guesses(guess: Sequence[int], included: Sequence[bool]) -> Guesses:
    made = sum(1 for x in guess if x != 0)
    correct = sum(1 for x, inc in zip(guess, included, strict=True) if x == (1 if inc else -1))
    return Guesses(tuple(guess), made, correct)


@dataclass(frozen=True)
class BoundResult:
    epsilon_lower_bound: float
    guesses: int
    correct: int
    k_plus: int
    k_minus: int
    confidence: float  # overall (after the Bonferroni split over the splits tried)
    tried: tuple[tuple[int, int, int, int, float], ...]  # (k+, k-, made, correct, bound)
    ceiling: float  # the bound had every guess been right: no claim above it can be refuted


def default_splits(m: int) -> list[tuple[int, int]]:
    """(k+, k-) pairs tried by default: k in 8, 16, ... up to m/2, both sides and top only."""
    ks = []
    k = 8
    while k < m // 2:
        ks.append(k)
        k *= 2
    ks.append(m // 2)
    return [(k, k) for k in ks] + [(k, 0) for k in ks]


def best_bound(
    scores: Sequence[float],
    included: Sequence[bool],
    splits: Sequence[tuple[int, int]],
    delta: float,
    confidence: float = 0.95,
) -> BoundResult:
    """Guess the k+ highest scores in and the k- lowest out, for each (k+, k-) in `splits`
    (fixed before the run); report the largest bound. Each split is tested at confidence
    1 - (1 - c) / len(splits) (Bonferroni), so the reported bound holds at confidence c."""
    m = len(scores)
    splits = sorted({(int(a), int(b)) for a, b in splits if a + b > 0 and a + b <= m})
    if not splits:
        raise AuditError(f"give at least one (k+, k-) with 0 < k+ + k- <= {m}")
    per = 1.0 - (1.0 - confidence) / len(splits)
    tried = []
    for kp, km in splits:
        g = score_guesses(guess_top_bottom(scores, kp, km), included)
        eps = epsilon_lower_bound(m, g.made, g.correct, delta, per)
        tried.append((kp, km, g.made, g.correct, eps))
    kp, km, made, correct, eps = max(tried, key=lambda t: (t[4], -t[2]))
    top = max(epsilon_lower_bound(m, a + b, a + b, delta, per) for a, b in splits)
    return BoundResult(eps, made, correct, kp, km, confidence, tuple(tried), top)

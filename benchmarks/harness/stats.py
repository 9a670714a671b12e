"""The two-sided t interval on the mean of paired differences, for every benchmark that
reports one (utility, causal_lm_ffa, federated_misspec): one quantile function, not a table
per script."""

from __future__ import annotations

import statistics


def t_interval(diffs: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """Two-sided t interval on the mean of paired differences (None below two pairs)."""
    from scipy import stats

    if len(diffs) < 2:
        return None
    m, se = statistics.fmean(diffs), statistics.stdev(diffs) / len(diffs) ** 0.5
    half = float(stats.t.ppf(0.5 + level / 2, len(diffs) - 1)) * se
    return m - half, m + half


def pairs_needed(sd: float, half_width: float, level: float = 0.95, most: int = 10_000) -> int:
    """The fewest pairs whose t interval is at most ``half_width`` either side of the mean
    when the paired differences spread with std ``sd`` (None-free: ``most`` caps it)."""
    from scipy import stats

    for n in range(2, most + 1):
        if float(stats.t.ppf(0.5 + level / 2, n - 1)) * sd / n**0.5 <= half_width:
            return n
    return most

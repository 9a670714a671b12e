"""Statistical checks on released noise, with bounds that fail about once in a million runs."""

from __future__ import annotations

import torch
from scipy import stats

ALPHA = 1e-6


def assert_std(z: torch.Tensor, std: float, alpha: float = ALPHA) -> None:
    """z holds i.i.d. N(0, std^2) draws: (n-1) s^2 / std^2 ~ chi2(n-1), mean ~ N(0, std^2/n)."""
    z = z.double().flatten()
    n = z.numel()
    assert n > 100, "too few draws for a statistical check"
    stat = (n - 1) * z.var().item() / std**2
    lo, hi = stats.chi2.ppf(alpha / 2, n - 1), stats.chi2.ppf(1 - alpha / 2, n - 1)
    assert lo <= stat <= hi, (
        f"sample std {z.std().item():.4g} vs expected {std:.4g} "
        f"(chi2 {stat:.1f} outside [{lo:.1f}, {hi:.1f}], n={n})"
    )
    bound = stats.norm.ppf(1 - alpha / 2) * std / n**0.5
    assert abs(z.mean().item()) <= bound, f"mean {z.mean().item():.3g} > {bound:.3g}"

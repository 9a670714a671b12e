"""Histogram of canary scores, included vs excluded, with the guess thresholds."""

from __future__ import annotations

from pathlib import Path

from dpfit.audit.central import AuditResult


def plot_scores(result: AuditResult, path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inc = [s for s, i in zip(result.scores, result.included_mask, strict=True) if i]
    exc = [s for s, i in zip(result.scores, result.included_mask, strict=True) if not i]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    lo, hi = min(result.scores), max(result.scores)
    bins = [lo + (hi - lo) * i / 50 for i in range(51)] if hi > lo else 10
    ax.hist(exc, bins=bins, alpha=0.6, label=f"excluded ({len(exc)})")
    ax.hist(inc, bins=bins, alpha=0.6, label=f"included ({len(inc)})")
    ordered = sorted(result.scores)
    if result.k_plus:
        ax.axvline(ordered[-result.k_plus], color="k", ls="--", lw=1, label="guess in / out")
    if result.k_minus:
        ax.axvline(ordered[result.k_minus - 1], color="k", ls="--", lw=1)
    ax.set_xlabel(f"canary score ({result.score})")
    ax.set_ylabel("canaries")
    ax.set_title(
        f"{result.kind}: claimed eps {result.epsilon_claimed:.2f}, "
        f"lower bound {result.epsilon_lower_bound:.2f} ({result.confidence:.0%})"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

"""Probe (issue 44, one-off, no training): can the server's public validation split see C*?

Every adaptive rule in the project steers on the public validation LOSS (DP-LAC's decay,
lac-2s's brake, the reverted lac-step's step search). In the misspecification protocol the
best fixed clip in hindsight, C* (chosen on the TEST split), is 0.25 at eps 2 and 1 at eps 8.
A rule driven by a validation signal can only find C* if that signal ranks the fixed clips as
the test split does. This reads the protocol's committed fixed-sweep runs
(``results/federated_misspec.jsonl``: 7 clips x 3 seeds per eps and partition) and, for each
validation signal the server has at the end of a run, picks per seed the clip it ranks best
and reports that clip's test accuracy minus C*'s (paired by seed, 95% t interval).

It is an upper bound for the signal, not a rule: picking among 7 finished private runs would
spend the budget 7 times. A signal that cannot pick C* in hindsight cannot steer a run to it.

    python benchmarks/archive/misspec_validation_signal.py
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks")]

from paired_t import t_interval  # noqa: E402

RUNS = ROOT / "benchmarks" / "results" / "federated_misspec.jsonl"
OUT = ROOT / "benchmarks" / "results" / "archive" / "misspec_validation_signal"
SWEEP = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 10.0)
TAIL = 3  # rounds averaged by the smoothed signals

# higher is better for each; the server has all of these for free (public data)
SIGNALS: dict[str, Callable[[list[dict]], float]] = {
    "last-round validation loss": lambda rr: -rr[-1]["val_loss"],
    f"validation loss, mean of the last {TAIL} rounds": lambda rr: (
        -statistics.fmean(x["val_loss"] for x in rr[-TAIL:])
    ),
    "last-round validation accuracy": lambda rr: rr[-1]["val_accuracy"],
    f"validation accuracy, mean of the last {TAIL} rounds": lambda rr: statistics.fmean(
        x["val_accuracy"] for x in rr[-TAIL:]
    ),
}


def sweeps(runs: list[dict]) -> dict[tuple[float, str], dict[float, dict[int, dict]]]:
    """(eps, partition) -> clip -> seed -> run, for the fixed rule's complete sweeps."""
    out: dict = {}
    for r in runs:
        if r["method"] == "fixed":
            cell = (r["epsilon_target"], r["partition"])
            out.setdefault(cell, {}).setdefault(r["c_init"], {})[r["seed"]] = r
    return {k: v for k, v in out.items() if all(c in v for c in SWEEP)}


def probe(runs: list[dict]) -> list[dict]:
    rows = []
    for (eps, part), by in sorted(sweeps(runs).items()):
        seeds = sorted(set.intersection(*(set(by[c]) for c in SWEEP)))
        test = {c: {s: by[c][s]["test_accuracy"] for s in seeds} for c in SWEEP}
        star = max(SWEEP, key=lambda c: statistics.fmean(test[c].values()))
        for name, signal in SIGNALS.items():
            picks = [max(SWEEP, key=lambda c: signal(by[c][s]["rounds"])) for s in seeds]
            diffs = [test[c][s] - test[star][s] for c, s in zip(picks, seeds, strict=True)]
            ci = t_interval(diffs)
            rows.append(
                dict(
                    eps=eps,
                    partition=part,
                    c_star=star,
                    signal=name,
                    seeds=seeds,
                    picks=picks,
                    minus_c_star=statistics.fmean(diffs),
                    interval=ci,
                )  # fmt: skip
            )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "# Can the public validation split see C*? (probe, no training)",
        "",
        f"From `{RUNS.relative_to(ROOT)}` (the fixed sweep), by "
        "`benchmarks/archive/misspec_validation_signal.py`. Per seed, the clip each signal ranks "
        "best at the end of the run; its test accuracy minus C*'s, paired by seed.",
        "",
        "| eps | partition | C* | validation signal | clip picked per seed | minus C* [95% interval] |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        ci = r["interval"]
        span = "" if ci is None else f" [{ci[0]:+.4f}, {ci[1]:+.4f}]"
        lines.append(
            f"| {r['eps']:g} | {r['partition']} | {r['c_star']:g} | {r['signal']} | "
            f"{', '.join(f'{c:g}' for c in r['picks'])} | {r['minus_c_star']:+.4f}{span} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    runs = [json.loads(line) for line in RUNS.read_text().splitlines() if line.strip()]
    rows = probe(runs)
    OUT.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    OUT.with_suffix(".md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()

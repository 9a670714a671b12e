"""What a run's epsilon reports cost: the accountant from scratch at every call, against the
ledger's cached one-step results (dpfit.accounting.ledger_epsilon), in one process.

    PYTHONPATH=src python benchmarks/accounting_cost.py [--rounds 3]

Replays the epsilon calls `dpfit train` makes on a private run with a head-first phase: the
head phase's engine reports epsilon after its last step, the main engine again after loading
that ledger, then one epsilon per main step for the steps.csv row (after head + 1, ..., head +
main steps), and at the end the other neighbouring relation (replace-one, always PLD). The
defaults are the bundled default job (`dpfit train` with no flags: n = 10233 training examples,
logical batch 1012, 3 + 3 epochs of 10 steps, epsilon 8, delta 1e-5, RDP, add-remove), its noise
multiplier calibrated here by the same call the run makes. Arms alternate, their order flipped
each round; CPU seconds (process time, which waiting for a shared core does not inflate), the
median over rounds. Every epsilon of the two arms must be the same float, or the script stops.
Writes benchmarks/results/accounting_cost.{json,md}. Budget: under a CPU-minute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import dp_accounting

from dpfit import accounting
from dpfit.accounting import PrivacyLedger, epsilon_of, noise_multiplier_for

RESULTS = Path(__file__).resolve().parent / "results"


def calls(head: int, main: int, relation: str) -> list[tuple[int, str]]:
    """(steps, neighbouring) of each epsilon the run computes, in order."""
    other = "replace-one" if relation == "add-remove" else "add-remove"
    ks = [head, head] if head else []  # head engine's last report, main engine after loading
    return [*((k, relation) for k in ks + list(range(head + 1, head + main + 1))),
            (head + main, other)]  # fmt: skip


def from_scratch(ledger: PrivacyLedger, k: int, relation: str) -> float:
    """What PrivacyLedger.epsilon computed before the cache: the composed event, accounted anew."""
    records = ledger.prefix(k).records
    event = dp_accounting.ComposedDpEvent([r.event() for r in records])
    return epsilon_of(event, ledger.delta, ledger.accountant, neighbouring=relation)


def cached(ledger: PrivacyLedger, k: int, relation: str) -> float:
    return ledger.prefix(k).epsilon(neighbouring=relation)


def run_arm(arm, ledger: PrivacyLedger, plan) -> tuple[tuple[float, float], list[float]]:
    """CPU seconds of the reports of the run's relation, and of the other relation's at the end."""
    accounting._one_step_rdp.cache_clear()  # a run starts cold
    accounting._one_step_pld.cache_clear()
    t0 = time.process_time()
    out = [arm(ledger, k, rel) for k, rel in plan[:-1]]
    t1 = time.process_time()
    out.append(arm(ledger, *plan[-1]))
    return (t1 - t0, time.process_time() - t1), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=10233)
    ap.add_argument("--batch", type=int, default=1012)
    ap.add_argument("--head-steps", type=int, default=30)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--epsilon", type=float, default=8.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--accountant", default="rdp", choices=accounting.ACCOUNTANTS)
    ap.add_argument("--neighbouring", default="add-remove", choices=accounting.NEIGHBOURING)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "accounting_cost"))
    args = ap.parse_args(argv)

    q = args.batch / args.n
    total = args.head_steps + args.steps
    t0 = time.process_time()
    sigma = noise_multiplier_for(
        args.epsilon, args.delta, q, total, args.accountant, neighbouring=args.neighbouring
    )
    calibrate_s = time.process_time() - t0
    ledger = PrivacyLedger(args.delta, args.accountant, neighbouring=args.neighbouring)
    for _ in range(total):
        ledger.record(sigma, q)
    plan = calls(args.head_steps, args.steps, args.neighbouring)
    arms = {"from scratch": from_scratch, "cached": cached}
    seconds: dict[str, list[float]] = {name: [] for name in arms}  # the run's relation
    other_s: dict[str, list[float]] = {name: [] for name in arms}  # the other, at the end
    for r in range(args.rounds):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        got = {}
        for name in order:
            (secs, other), got[name] = run_arm(arms[name], ledger, plan)
            seconds[name].append(secs)
            other_s[name].append(other)
        if got["from scratch"] != got["cached"]:
            raise SystemExit(f"the arms disagree: {got}")
        print(f"round {r + 1}: " + ", ".join(f"{a} {seconds[a][-1]:.3f} s" for a in arms))
    med = {a: statistics.median(s) for a, s in seconds.items()}
    med_other = {a: statistics.median(s) for a, s in other_s.items()}
    command = "PYTHONPATH=src python benchmarks/accounting_cost.py" + (
        " " + " ".join(argv if argv is not None else sys.argv[1:])
        if (argv if argv is not None else sys.argv[1:])
        else ""
    )
    result = {
        "command": command,
        "sample_rate": q,
        "noise_multiplier": sigma,
        "steps": {"head_first": args.head_steps, "main": args.steps},
        "epsilon_calls": len(plan),
        "per_step_calls": args.steps,
        "calibration_cpu_s": calibrate_s,
        "cpu_s": seconds,
        "median_cpu_s": med,
        "other_relation_cpu_s": other_s,
        "median_other_relation_cpu_s": med_other,
        "ratio_from_scratch_over_cached": med["from scratch"] / med["cached"],
        "final_epsilons": {
            rel: eps for (_, rel), eps in zip(plan[-2:], got["cached"][-2:], strict=True)
        },
        "load_average_1m": os.getloadavg()[0],
        "cpu_count": os.cpu_count(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Epsilon reports of one run: accountant from scratch vs cached one-step results",
        "",
        f"Generated by `{command}`: the {len(plan)} epsilon calls of a run with "
        f"{args.head_steps} head-first and {args.steps} main steps (q = {q:.4g}, sigma = "
        f"{sigma:.4g}, {args.accountant.upper()}, {args.neighbouring}; the last call is the "
        "other relation's), each arm timed as CPU seconds of one process, arms alternated, "
        f"median of {args.rounds} rounds; every epsilon of the two arms is the same float. "
        f"Load average {result['load_average_1m']:.1f} on {os.cpu_count()} cores.",
        "",
        f"| arm | {args.neighbouring} reports: CPU s per run (median) | CPU s per report | "
        "rounds | the other relation at the end: CPU s (median) |",
        "|---|---|---|---|---|",
    ]
    for a in arms:
        per_call = med[a] / max(1, len(plan) - 1)
        rounds = ", ".join(f"{s:.3f}" for s in seconds[a])
        lines.append(f"| {a} | {med[a]:.3f} | {per_call:.5f} | {rounds} | {med_other[a]:.3f} |")
    lines += [
        "",
        f"{args.neighbouring} reports, from scratch / cached: "
        f"{result['ratio_from_scratch_over_cached']:.0f}x. Calibrating sigma before the run "
        f"(unchanged, not cached): {calibrate_s:.2f} CPU s.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Empirical privacy audit: how close the one-run bound gets to the claim, which injected faults
it catches (and at what canary count), and how long the bundled-model CPU audit takes.

Parts (all by default):
    ideal      the method's ceiling without a model (Gaussian observations), and the idealised
               shuffled-batches fault
    blackbox   black-box input canaries on the synthetic model, correct and with no noise and
               no clipping
    ideal      the method's ceiling without a model (Gaussian observations), and the idealised
               shuffled-batches fault
    blackbox   black-box input canaries on the synthetic model, correct and with no noise and
               no clipping
    toy        white-box bound vs claim at eps 1, 4, 8 (3 seeds each) on the synthetic bias-only
               model (dpfit.audit.toy), m = 1000 and, at eps 8, m = 4000
    faults     the faults of tests/audit/faults.py at a claimed eps of 2, m in 100/300/1000;
               the shuffled-batches fault at q = 0.1 over one epoch (10 steps)
    federated  the DP-FedAvg server core: correct, and with the noise on the mean
    bundled    `dpfit audit` on the bundled MiniLM + Rotten Tomatoes, white-box and black-box,
               wall time on this machine's CPU

    python benchmarks/audit.py [--parts toy,faults,federated,bundled]

Writes benchmarks/results/audit.json, audit.md, audit_toy.png, audit_bundled.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

from harness.workers import last_json_line
from torch import nn

from dpfit.audit.central import AuditConfig, white_box_audit
from dpfit.audit.plot import plot_scores
from dpfit.audit.toy import TOY_TARGETS, toy_collate, toy_items, toy_losses, toy_model

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "results"
REAL = 100


def _faults():
    spec = importlib.util.spec_from_file_location("faults", ROOT / "tests" / "audit" / "faults.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def toy_run(eps, seed, m, width=None, targets=TOY_TARGETS, **kw):
    width = width or max(512, m // 2)
    cfg = AuditConfig(epsilon=eps, canaries=m, insecure_seed=seed, **kw)
    return white_box_audit(
        toy_model(width=width, seed=seed),
        toy_items(REAL, seed=seed),
        toy_collate,
        toy_losses,
        targets,
        cfg,
    )


def row(name, r, **extra):
    d = {
        "case": name,
        "kind": r.kind,
        "epsilon_claimed": round(r.epsilon_claimed, 4),
        "epsilon_lower_bound": round(r.epsilon_lower_bound, 4),
        "epsilon_ceiling": round(r.epsilon_ceiling, 4),
        "ratio": round(r.ratio, 4),
        "detected": r.violated,
        "canaries": r.canaries,
        "guesses": r.guesses,
        "correct": r.correct,
        "steps": r.steps,
        "sample_rate": round(r.sample_rate, 4),
        "sigma": round(r.noise_multiplier, 4),
        "seconds": round(r.seconds, 1),
    }
    d.update(extra)
    print(json.dumps(d), flush=True)
    return d


def part_toy():
    rows = []
    for eps in (1.0, 4.0, 8.0):
        for seed in range(3):
            rows.append(row(f"correct eps={eps:g}", toy_run(eps, seed, 1000), seed=seed))
    best = None
    for seed in range(3):
        r = toy_run(8.0, seed, 4000)
        rows.append(row("correct eps=8", r, seed=seed))
        best = r if best is None or r.epsilon_lower_bound > best.epsilon_lower_bound else best
    plot_scores(best, OUT / "audit_toy.png")
    return rows


def part_faults():
    f = _faults()
    claim = 2.0
    cases = [
        ("noise 10x too small", lambda m: f.noise_scaled(0.1), {}),
        ("noise on the mean", lambda m: f.noise_on_mean(REAL + m), {}),
        ("clipping off (all)", lambda m: f.clipping_off(), {}),
        (
            "clipping off (LayerNorm), canaries in both",
            lambda m: f.clipping_off_for(nn.LayerNorm),
            {},
        ),
        (
            "clipping off (LayerNorm), canaries in Linear only",
            lambda m: f.clipping_off_for(nn.LayerNorm),
            {"targets": ("0",)},
        ),
    ]
    rows = []
    for name, fault, kw in cases:
        for m in (100, 300, 1000):
            with fault(m):
                rows.append(row(name, toy_run(claim, 0, m, **kw), claim=claim))
    # shuffling claimed as Poisson: q = 0.1, one epoch; sigma set for eps = 2 at Poisson q
    for score in ("max", "llr"):
        with f.shuffled_batches():
            r = toy_run(claim, 0, 1000, steps=10, sample_rate=0.1, score=score)
        rows.append(row(f"fixed shuffled batches ({score} score)", r, claim=claim))
    return rows


def part_federated():
    from dpfit.audit.federated import FederatedAuditConfig, federated_audit
    from dpfit.federated.clipping import FixedClip

    rows = []
    for eps in (1.0, 8.0):
        r = federated_audit(FederatedAuditConfig(epsilon=eps, canaries=1000, insecure_seed=0))
        rows.append(row(f"federated correct eps={eps:g}", r))
    real = FixedClip.update_noise_std
    try:
        FixedClip.update_noise_std = lambda self: real(self) / self.config.expected_clients
        r = federated_audit(FederatedAuditConfig(epsilon=2.0, canaries=1000, insecure_seed=0))
        rows.append(row("federated noise on the mean", r, claim=2.0))
    finally:
        FixedClip.update_noise_std = real
    return rows


def part_bundled():
    rows = []
    for kind, extra in (
        ("white-box", []),
        ("black-box", ["--canaries-count", "200", "--steps", "2"]),
    ):
        plot = ["--plot", "benchmarks/results/audit_bundled.png"] if kind == "white-box" else []
        cmd = [
            sys.executable,
            "-m",
            "dpfit.cli",
            "audit",
            "--canaries",
            kind,
            "--json",
            *extra,
            *plot,
        ]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
        wall = time.perf_counter() - t0
        if out.returncode not in (0, 3):
            raise RuntimeError(out.stderr[-2000:])
        d = last_json_line(out.stdout)
        d = {k: v for k, v in d.items() if k != "tried"}
        d.update(
            case=f"bundled {kind}", command=" ".join(["dpfit", *cmd[3:]]), wall_s=round(wall, 1)
        )
        print(json.dumps(d), flush=True)
        rows.append(d)
    return rows


def part_ideal():
    """The ceiling of the method, without any model: per canary one Gaussian observation
    (eps-calibrated sigma, q = 1, one step) or, for shuffling, one epoch of T = 1/q steps with
    the canary in exactly one of them. Same bound, same splits."""
    import torch

    from dpfit.accounting import noise_multiplier_for
    from dpfit.audit.bounds import best_bound, default_splits
    from dpfit.audit.canaries import scores_from_observations

    def record(case, m, steps, q, sigma, eps, b):
        d = {
            "case": case,
            "canaries": m,
            "steps": steps,
            "sample_rate": q,
            "sigma": round(sigma, 4),
            "epsilon_claimed": eps,
            "epsilon_lower_bound": round(b.epsilon_lower_bound, 4),
            "epsilon_ceiling": round(b.ceiling, 4),
            "ratio": round(b.epsilon_lower_bound / eps, 4),
            "guesses": b.guesses,
            "correct": b.correct,
            "detected": b.epsilon_lower_bound > eps,
        }
        print(json.dumps(d), flush=True)
        return d

    rows = []
    gen = torch.Generator().manual_seed(0)
    for eps, m in ((8.0, 1000), (8.0, 4000), (8.0, 16000), (2.0, 1000)):
        sigma = noise_multiplier_for(eps, 1e-5, 1.0, 1, "rdp")
        inc = torch.rand(m, generator=gen) < 0.5
        x = inc.float() + sigma * torch.randn(m, generator=gen)
        b = best_bound(x.tolist(), inc.tolist(), default_splits(m), 1e-5)
        rows.append(record(f"ideal Gaussian eps={eps:g}", m, 1, 1.0, sigma, eps, b))
    q, steps, eps, m = 0.1, 10, 2.0, 4000
    sigma = noise_multiplier_for(eps, 1e-5, q, steps, "rdp")
    inc = torch.rand(m, generator=gen) < 0.5
    x = sigma * torch.randn(steps, m, generator=gen)
    x[torch.randint(0, steps, (m,), generator=gen), torch.arange(m)] += inc.float()
    for score in ("max", "llr"):
        s = scores_from_observations(x, score, q, sigma)
        b = best_bound(s.tolist(), inc.tolist(), default_splits(m), 1e-5)
        rows.append(
            record(f"ideal shuffled, claimed Poisson ({score})", m, steps, q, sigma, eps, b)
        )
    return rows


def part_blackbox():
    """Black-box input canaries on the synthetic model: correct engine, and with no noise and
    no clipping at all (the strongest fault) at a claimed eps of 1."""
    from dpfit.audit.central import black_box_audit
    from dpfit.audit.toy import toy_canary_items

    f = _faults()
    rows = []
    for broken in (False, True):
        cfg = AuditConfig(epsilon=1.0, canaries=200, steps=20, lr=0.5, insecure_seed=0)
        args = (toy_model(width=64), toy_items(200), toy_canary_items(200), toy_collate, toy_losses)
        if broken:
            with f.noise_scaled(0.0), f.clipping_off():
                r = black_box_audit(*args, cfg)
        else:
            r = black_box_audit(*args, cfg)
        name = "black-box no noise, no clipping" if broken else "black-box correct"
        rows.append(row(name, r, claim=1.0))
    return rows


PARTS = {
    "ideal": part_ideal,
    "blackbox": part_blackbox,
    "toy": part_toy,
    "faults": part_faults,
    "federated": part_federated,
    "bundled": part_bundled,
}


def markdown(results: dict) -> str:
    lines = ["# Privacy audit benchmark", "", "Generated by `benchmarks/audit.py`.", ""]
    for part, rows in results.items():
        lines += [f"## {part}", ""]
        keys = [
            "case",
            "canaries",
            "steps",
            "sample_rate",
            "sigma",
            "epsilon_claimed",
            "epsilon_lower_bound",
            "epsilon_ceiling",
            "ratio",
            "guesses",
            "correct",
            "detected",
        ]
        if part == "bundled":
            keys = [
                "case",
                "canaries",
                "steps",
                "epsilon_claimed",
                "epsilon_lower_bound",
                "ratio",
                "guesses",
                "correct",
                "seconds",
                "wall_s",
            ]
        lines.append("| " + " | ".join(keys) + " |")
        lines.append("|" + "---|" * len(keys))
        for r in rows:
            lines.append("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("absl").setLevel(logging.ERROR)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "audit.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for name in args.parts.split(","):
        results[name] = PARTS[name]()
        path.write_text(json.dumps(results, indent=1) + "\n")
    (OUT / "audit.md").write_text(markdown(results))


if __name__ == "__main__":
    main()

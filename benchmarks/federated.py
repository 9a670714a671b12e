"""Federated clip rules at equal privacy: fixed (C=1), quantile-adaptive, DP-LAC, DP-CLAC.

Dirichlet(alpha) label-skewed clients from the bundled Rotten Tomatoes data, same seeds and
rounds for every method, noise calibrated so all meet the same client-level epsilon. Runs
in-process (``LocalGrid``; the same ClientApp and Strategy as the Flower engines). Tuning cost:
each baseline is also run over a small grid (best on validation, reported on test) and the
number of training runs that takes is reported next to the untuned default.

    python benchmarks/federated.py                 # minutes on 2 CPU cores
    python benchmarks/federated.py --local-mode bias --clients 20 --clients-per-round 5

Prints a markdown table; writes benchmarks/results/federated.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from dpfit.federated.app import make_evaluate_fn, run_local
from dpfit.federated.client import TaskConfig
from dpfit.federated.strategy import ServerConfig

METHODS = ("fixed", "adaptive-quantile", "lac", "clac")
# Small tuning grids: what a practitioner would try; LAC and CLAC add no hyperparameter.
GRIDS: dict[str, list[dict]] = {
    "fixed": [{"initial_clip": c} for c in (0.1, 0.3, 1.0, 3.0)],
    "adaptive-quantile": [{"target_quantile": g} for g in (0.3, 0.5, 0.7)],
    "lac": [{}],
    "clac": [{}],
}
# The untuned setting of each method inside its grid: C=1, median target (Andrew et al.).
DEFAULTS: dict[str, dict] = {
    "fixed": {"initial_clip": 1.0},
    "adaptive-quantile": {"target_quantile": 0.5},
    "lac": {},
    "clac": {},
}


def run_one(method: str, eps: float, seed: int, args: argparse.Namespace, **overrides) -> dict:
    task = TaskConfig(
        local_mode=args.local_mode,
        max_length=args.max_length,
        local_epochs=args.local_epochs,
        local_batch_size=args.local_batch_size,
        lr=args.lr,
        num_clients=args.clients,
        partition="dirichlet",
        alpha=args.alpha,
        examples_per_client=args.examples_per_client,
        eval_examples=args.eval_examples,
        seed=args.data_seed,
    )
    cfg = ServerConfig(
        method=method,
        num_clients=args.clients,
        clients_per_round=args.clients_per_round,
        rounds=args.rounds,
        target_epsilon=eps,
        delta=args.delta,
        initial_clip=1.0,
        seed=seed,
    )
    cfg = replace(cfg, **overrides)
    t0 = time.perf_counter()
    server = run_local(cfg, task)
    test_loss, test_acc = make_evaluate_fn(task, "test")(server.params)
    return {
        "method": method,
        "epsilon_target": eps,
        "epsilon": server.accountant.epsilon(),
        "seed": seed,
        "overrides": overrides,
        "val_loss": server.history[-1].val_loss,
        "val_accuracy": server.history[-1].accuracy,
        "test_accuracy": test_acc,
        "test_loss": test_loss,
        "initial_clip": server.initial_clip,
        "final_clip": server.rule.clip_norm,
        "clips": [r.clip_norm for r in server.history],
        "seconds": time.perf_counter() - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--clients-per-round", type=float, default=20)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--local-mode", default="head", choices=("head", "bias", "lora"))
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--local-batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--examples-per-client", type=int, default=40)
    p.add_argument("--eval-examples", type=int, default=300)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--no-tune", action="store_true", help="skip the tuning grids")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)

    rows: list[dict] = []
    t0 = time.perf_counter()
    for eps in args.epsilons:
        for method in METHODS:
            grid = [{}] if args.no_tune else GRIDS[method]
            for overrides in grid:
                for seed in args.seeds:
                    r = run_one(method, eps, seed, args, **overrides)
                    rows.append(r)
                    print(
                        f"eps={eps:g} {method:18s} {overrides} seed={seed} "
                        f"test_acc={r['test_accuracy']:.3f} C0={r['initial_clip']:.3g} "
                        f"C_T={r['final_clip']:.3g} ({r['seconds']:.0f}s)",
                        flush=True,
                    )

    def mean_acc(method: str, eps: float, overrides: dict, key: str) -> float:
        xs = [
            r[key]
            for r in rows
            if r["method"] == method and r["epsilon_target"] == eps and r["overrides"] == overrides
        ]
        return statistics.mean(xs)

    table = []
    for method in METHODS:
        default = {} if args.no_tune else DEFAULTS[method]
        line = {"method": method, "runs_to_tune": len(GRIDS[method])}
        for eps in args.epsilons:
            line[f"default@{eps:g}"] = mean_acc(method, eps, default, "test_accuracy")
            if not args.no_tune:
                best = max(
                    GRIDS[method], key=lambda o, e=eps: mean_acc(method, e, o, "val_accuracy")
                )
                line[f"tuned@{eps:g}"] = mean_acc(method, eps, best, "test_accuracy")
        line["default_mean"] = statistics.mean(line[f"default@{e:g}"] for e in args.epsilons)
        table.append(line)

    head = ["method", "runs to tune"]
    head += [f"eps={e:g} default" for e in args.epsilons]
    if not args.no_tune:
        head += [f"eps={e:g} tuned" for e in args.epsilons]
    head += ["mean default"]
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for line in table:
        cells = [line["method"], str(line["runs_to_tune"])]
        cells += [f"{line[f'default@{e:g}']:.3f}" for e in args.epsilons]
        if not args.no_tune:
            cells += [f"{line[f'tuned@{e:g}']:.3f}" for e in args.epsilons]
        cells += [f"{line['default_mean']:.3f}"]
        print("| " + " | ".join(cells) + " |")
    print(f"\n{len(rows)} runs in {time.perf_counter() - t0:.0f}s; settings: {vars(args)}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "federated.json").write_text(
        json.dumps({"settings": vars(args), "table": table, "runs": rows}, indent=1)
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        for line in table:
            ax.plot(
                args.epsilons,
                [line[f"default@{e:g}"] for e in args.epsilons],
                marker="o",
                label=line["method"],
            )
        ax.set_xlabel("client-level epsilon")
        ax.set_ylabel("test accuracy (untuned)")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "federated.png", dpi=110)
    except ImportError:
        pass


if __name__ == "__main__":
    main()

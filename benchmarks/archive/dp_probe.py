"""DP linear probe on cached frozen features: a cheap stand-in for the recipe's DP regime.

DP-SGD (Poisson sampling, per-example clipping, Gaussian noise calibrated with dpfit's
accountant, Adam) on a zero-initialised linear head over frozen MiniLM features. Per-example
gradients of a linear softmax head are exact and cheap, so a whole grid costs CPU-seconds
while one bias-only run costs CPU-minutes. It answers: which pooling, what batch fraction,
lr, clipping and epochs work under DP noise in this model's feature space, and what the
head-first phase of a run can reach on its own. Features are L2-normalised per example (no
statistic of the private data is used). Noise comes from a seeded torch generator: this is a
simulation for choosing defaults, not a private release.

    python benchmarks/archive/dp_probe.py --tasks rotten-tomatoes
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import functools  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # archived: baselines is one up

import baselines  # noqa: E402

from dpfit.accounting import noise_multiplier_for  # noqa: E402
from dpfit.data.tasks import HELD_OUT, TASKS, load_task  # noqa: E402


@functools.cache
def sigma_for(epsilon: float, n: int, q: float, steps: int) -> float:
    return noise_multiplier_for(epsilon, min(1e-5, n**-1.1), q, steps)


OUT = Path(__file__).resolve().parents[1] / "results" / "archive" / "dp_probe.jsonl"


def dp_probe(
    x: torch.Tensor,
    y: torch.Tensor,
    xt: torch.Tensor,
    yt: torch.Tensor,
    classes: int,
    *,
    epsilon: float | None,
    b_frac: float,
    lr: float,
    epochs: int,
    clipping: str,
    R: float,
    seed: int,
) -> tuple[float, float]:
    """Test accuracy and sigma of one DP-SGD (or plain, epsilon=None) linear-probe run."""
    n, d = x.shape
    g = torch.Generator().manual_seed(seed)
    B = max(1, round(b_frac * n))
    q = B / n
    steps = epochs * max(1, round(n / B))
    sigma = 0.0 if epsilon is None else sigma_for(epsilon, n, q, steps)
    w = torch.zeros(d + 1, classes)
    opt = torch.optim.Adam([w.requires_grad_()], lr=lr)
    xb = torch.cat([x, torch.ones(n, 1)], 1)
    for _ in range(steps):
        idx = torch.nonzero(torch.rand(n, generator=g) < q).squeeze(1)
        with torch.no_grad():
            xi = xb[idx]
            p = torch.softmax(xi @ w, -1)
            p[torch.arange(len(idx)), y[idx]] -= 1  # dL/dlogits per example
            norms = p.norm(dim=1) * xi.norm(dim=1)  # ||outer(x, p)|| = ||x|| ||p||
            if epsilon is None:
                scale = torch.ones_like(norms)
            elif clipping == "automatic":
                scale = R / (norms + 0.01)
            else:
                scale = torch.clamp(R / (norms + 1e-12), max=1.0)
            grad = (xi * scale[:, None]).T @ p
            grad += sigma * R * torch.randn(grad.shape, generator=g)
            w.grad = grad / B
        opt.step()
    with torch.no_grad():
        xtb = torch.cat([xt, torch.ones(len(xt), 1)], 1)
        acc = float(((xtb @ w).argmax(-1) == yt).float().mean())
    return acc, sigma


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # the held-out tasks only check the recipe: never tune on them
    tuning = [t for t in TASKS if t not in HELD_OUT]
    p.add_argument("--tasks", nargs="+", default=tuning, choices=tuning)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    torch.set_num_threads(1)
    grid = list(
        itertools.product(
            ("mean", "cls", "pooler"),
            (8.0, 1.0, None),
            (0.1, 0.02, 0.25),
            (1e-2, 1e-1),
            (3,),
            ("automatic",),
        )
    )
    with open(args.out, "a") as f:
        for name in args.tasks:
            task = load_task(name, args.seed)
            ftr = baselines.frozen_features(task.train.texts, baselines.PROBE_MAX_LENGTH)
            fte = baselines.frozen_features(task.test.texts, baselines.PROBE_MAX_LENGTH)
            y = torch.tensor(task.train.labels)
            yt = torch.tensor(task.test.labels)
            for pooling, eps, b_frac, lr, epochs, clipping in grid:
                if eps is None and clipping == "flat":
                    continue
                x = torch.nn.functional.normalize(torch.tensor(ftr[pooling]), dim=1)
                xt = torch.nn.functional.normalize(torch.tensor(fte[pooling]), dim=1)
                t = time.perf_counter()
                acc, sigma = dp_probe(
                    x,
                    y,
                    xt,
                    yt,
                    task.num_labels,
                    epsilon=eps,
                    b_frac=b_frac,
                    lr=lr,
                    epochs=epochs,
                    clipping=clipping,
                    R=1.0 if clipping == "automatic" else 0.1,
                    seed=args.seed,
                )
                row = dict(
                    task=name,
                    n=len(y),
                    pooling=pooling,
                    epsilon=eps,
                    b_frac=b_frac,
                    lr=lr,
                    epochs=epochs,
                    clipping=clipping,
                    sigma=sigma,
                    accuracy=acc,
                    wall_s=time.perf_counter() - t,
                )
                f.write(json.dumps(row) + "\n")
                f.flush()
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

"""Where DP-BiTFiT's time per step goes, against non-private bias-only training: forward,
backward and step, as CPU (thread) time, on one fixed batch.

    PYTHONPATH=src python benchmarks/archive/engine_phases.py [--steps 300] [--model tiny|resnet-gn]

`--model tiny` (default): the tiny encoder of benchmarks/distributed.py, one fixed batch of 32.
`--model resnet-gn`: the GroupNorm ResNet of dpfit.vision (biases + the linear head train), one
fixed batch of 16 images (`--batch`) at `--image-size` pixels (28), as in `benchmarks/vision.py scan`, with
AdamW as there. One thread; the same batch for every
arm and step (no sampling noise in the comparison; the engine runs with
sampling="user-poisson" so that no loader is involved): non-private bias-only training, the
engine, and the engine without its per-step gradient check. The arms alternate step by step
in one process; each phase is reported at the 30th percentile and the median over the steps
(the lower quantile is less disturbed by other jobs on a shared machine).
Writes benchmarks/results/archive/engine_phases.{json,md} (tiny) or
engine_phases_resnet-gn_<size>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # archived in benchmarks/archive/
RESULTS = ROOT / "benchmarks" / "results" / "archive"
BATCH = 32
PHASES = ("forward", "backward", "step", "total")


def tiny_workload() -> tuple:
    """The tiny encoder, a batch of 32, SGD at lr 0 (every step the same work)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import distributed as bench

    data = bench.Tokens()
    x, y = data.x[:BATCH].clone(), data.y[:BATCH].clone()
    return bench.make_model("bias"), x, y, bench.N, lambda ps: torch.optim.SGD(ps, lr=0.0)


def resnet_workload(size: int, batch: int = 16) -> tuple:
    """benchmarks/vision.py scan's DP-BiTFiT set-up: resnet-gn, 16 images (or `batch`), AdamW."""
    import numpy as np
    import torch

    import dpfit
    from dpfit.vision.data import to_pixels
    from dpfit.vision.models import build_model

    m = build_model("resnet-gn", [str(i) for i in range(10)], 1, size, seed=0)
    model = m.module.train()
    dpfit.make_bias_trainable(model, train_head=m.head_names)
    rng = np.random.default_rng(0)
    x = to_pixels(rng.integers(0, 256, (batch, 1, 28, 28), dtype=np.uint8), 1, size)
    y = torch.from_numpy(rng.integers(0, 10, batch))
    return model, x, y, 10_000, lambda ps: torch.optim.AdamW(ps, lr=1e-3)


VISION_BATCH = 16


def make_arm(kind: str, workload: Callable[[], tuple]) -> Callable[[], tuple[float, float, float]]:
    """One training step of `kind`, returning the CPU seconds of its three phases."""
    from torch import nn

    import dpfit

    model, x, y, n, make_opt = workload()
    batch = len(x)
    if kind == "nonprivate":
        opt = make_opt([p for p in model.parameters() if p.requires_grad])

        def finish() -> None:
            opt.step()
            opt.zero_grad()
    else:
        engine = dpfit.PrivacyEngine(
            model,
            expected_batch_size=batch,
            sample_size=n,
            noise_multiplier=1.0,
            sampling="user-poisson",
            check_gradients=kind == "dp",
        )
        opt = make_opt(engine.parameters())

        def finish() -> None:
            engine.step(opt, batch_size=batch)

    def run() -> tuple[float, float, float]:
        t0 = time.thread_time()
        loss = nn.functional.cross_entropy(model(x), y)
        t1 = time.thread_time()
        loss.backward()
        t2 = time.thread_time()
        finish()
        return t1 - t0, t2 - t1, time.thread_time() - t2

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--model", choices=("tiny", "resnet-gn"), default="tiny")
    ap.add_argument("--image-size", type=int, default=28, help="resnet-gn only")
    ap.add_argument(
        "--batch", type=int, default=VISION_BATCH, help="resnet-gn only: images per step"
    )
    args = ap.parse_args()
    import functools

    import torch

    torch.set_num_threads(1)
    if args.model == "tiny":
        workload, stem, what = (
            tiny_workload,
            "engine_phases",
            (
                f"The tiny encoder of `benchmarks/distributed.py` (one\nthread), one fixed batch "
                f"of {BATCH} for every step"
            ),
        )
    else:
        workload = functools.partial(resnet_workload, args.image_size, args.batch)
        stem = f"engine_phases_resnet-gn_{args.image_size}"
        if args.batch != VISION_BATCH:  # the fixed per-step cost against a larger step
            stem += f"_b{args.batch}"
        what = (
            f"resnet-gn at {args.image_size}x{args.image_size} (biases and the head train, AdamW; "
            f"one\nthread), one fixed batch of {args.batch} images for every step"
        )
    arms = {kind: make_arm(kind, workload) for kind in ("nonprivate", "dp", "dp_no_check")}
    for run in arms.values():  # warm-up
        run(), run(), run()
    times: dict[str, list[tuple[float, float, float]]] = {k: [] for k in arms}
    names = list(arms)
    load = [os.getloadavg()[0]]
    for i in range(args.steps):
        for k in names if i % 2 else names[::-1]:
            times[k].append(arms[k]())
    load.append(os.getloadavg()[0])

    def quantiles(rows: list[tuple[float, float, float]]) -> dict[str, dict[str, float]]:
        cols = [*zip(*rows, strict=True), [sum(r) for r in rows]]
        out = {}
        for phase, col in zip(PHASES, cols, strict=True):
            q = statistics.quantiles(col, n=10)
            out[phase] = {"p30_ms": 1000 * q[2], "median_ms": 1000 * q[4]}
        return out

    summary = {k: quantiles(v) for k, v in times.items()}
    result = {
        "command": " ".join(["python benchmarks/archive/engine_phases.py", *sys.argv[1:]]),
        "steps": args.steps,
        "model": args.model,
        "image_size": args.image_size if args.model == "resnet-gn" else None,
        "batch": BATCH if args.model == "tiny" else args.batch,
        "load_average_1min": load,
        "cpus": os.cpu_count(),
        "arms": summary,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    base = summary["nonprivate"]
    rows = []
    for k, s in summary.items():
        cells = []
        for phase in PHASES:
            p30, extra = s[phase]["p30_ms"], s[phase]["p30_ms"] - base[phase]["p30_ms"]
            cells.append(f"{p30:.2f}" if k == "nonprivate" else f"{p30:.2f} ({extra:+.2f})")
        rows.append(f"| {k} | " + " | ".join(cells) + " |")
    md = f"""# Where the engine's time goes (one process, one fixed batch)

Output of `{result["command"]}`. {what}; the arms alternate step by step,
{args.steps} steps each. CPU (thread) ms per step at the 30th percentile over the steps, in
brackets the difference to non-private bias-only training. 1-minute load average at the
start and end: {", ".join(f"{x:.1f}" for x in load)} ({os.cpu_count()} CPUs).

| arm | forward | backward | step | total |
|---|---|---|---|---|
{chr(10).join(rows)}
"""
    (RESULTS / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

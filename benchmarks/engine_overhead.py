"""The engine's own cost per example, in one process: DP-BiTFiT against non-private bias-only
training of the same model, as CPU time per example (what waiting for a shared core does not
inflate), optionally for an older revision of the engine side by side in the same run.

    PYTHONPATH=src python benchmarks/engine_overhead.py [--baseline REV] [--rounds 6 --steps 8]

One process stands for one rank of benchmarks/distributed.py: its tiny encoder (d=128, seq
32), Poisson batches of expected size 32 (half of that benchmark's logical batch) through the
engine's loader, against fixed batches of 32, and DP-BiTFiT once more without the per-step
gradient check (`check_gradients=False`) to show what that check costs. Each round runs one
worker process per source tree (order flipped every round); inside a worker the arms alternate
step by step.
`--baseline REV` extracts `src/` of that git revision into a temporary folder and measures it
the same way. Writes benchmarks/results/engine_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PER_RANK = 32  # one rank's expected share of distributed.py's logical batch of 64


def worker(steps: int) -> dict:
    """CPU seconds per example of each arm, alternating step by step."""
    import torch
    from torch import nn

    import dpfit

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import distributed as bench  # the same model and data

    torch.set_num_threads(1)
    data = bench.Tokens()

    def dp_arm(**kw: bool) -> Callable[[], int]:
        model = bench.make_model("bias")
        engine = dpfit.PrivacyEngine(
            model, expected_batch_size=PER_RANK, sample_size=bench.N, noise_multiplier=1.0, **kw
        )
        opt = torch.optim.SGD(engine.parameters(), lr=0.01)
        # older revisions (--baseline) have no optimizer= (empty batches, rare here, step late)
        takes_optimizer = "optimizer" in inspect.signature(engine.data_loader).parameters
        extra = {"optimizer": opt} if takes_optimizer else {}
        batches = iter(engine.data_loader(data, physical_batch_size=bench.PHYS, **extra))

        def step() -> int:
            n = 0
            while True:
                x, y = next(batches)
                nn.functional.cross_entropy(model(x), y).backward()
                n += len(x)
                if engine.step(opt):
                    return n

        return step

    np_model = bench.make_model("bias")
    np_opt = torch.optim.SGD([p for p in np_model.parameters() if p.requires_grad], lr=0.01)
    count = [0]

    def np_step() -> int:
        start = (count[0] * PER_RANK) % (bench.N - PER_RANK)
        count[0] += 1
        chunk = range(start, start + PER_RANK)
        x = torch.stack([data[j][0] for j in chunk])
        y = torch.stack([data[j][1] for j in chunk])
        nn.functional.cross_entropy(np_model(x), y).backward()
        np_opt.step()
        np_opt.zero_grad()
        return PER_RANK

    arms = {
        "dp": dp_arm(),
        "nonprivate": np_step,
        "dp_no_check": dp_arm(check_gradients=False),
    }
    for step in arms.values():  # warm-up
        step(), step()
    cpu = {name: 0.0 for name in arms}
    examples = {name: 0 for name in arms}
    for i in range(steps):
        order = list(arms)[i % len(arms) :] + list(arms)[: i % len(arms)]
        for name in order if i % 2 == 0 else list(reversed(order)):
            c = time.thread_time()
            examples[name] += arms[name]()
            cpu[name] += time.thread_time() - c
    return {name: cpu[name] / examples[name] for name in arms}


def run_worker(src: Path, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--worker", str(steps)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="git revision whose engine to measure side by side")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8, help="steps per arm per worker")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="dpfit-overhead-") as tmp:
        sources = {f"this tree (HEAD {head})": ROOT / "src"}
        if args.baseline:
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", args.baseline, "src"],
                capture_output=True, check=True,
            ).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
            sources[f"baseline {args.baseline}"] = Path(tmp) / "src"
        runs: dict[str, list[dict]] = {name: [] for name in sources}
        loads = [os.getloadavg()[0]]
        for r in range(args.rounds):
            order = list(sources) if r % 2 == 0 else list(reversed(sources))
            for name in order:
                res = run_worker(sources[name], args.steps)
                runs[name].append(res)
                print(
                    f"round {r} {name}: DP {1000 * res['dp']:.3f} ms/example, non-private "
                    f"{1000 * res['nonprivate']:.3f}: overhead "
                    f"{100 * (res['dp'] / res['nonprivate'] - 1):.1f}%",
                    flush=True,
                )
            loads.append(os.getloadavg()[0])
            write(args, runs, loads, r + 1)  # after every round: a stopped run keeps its rounds


def write(args: argparse.Namespace, runs: dict[str, list[dict]], loads: list[float], done: int):
    summary = {}
    for name, rs in runs.items():
        over = [r["dp"] / r["nonprivate"] - 1 for r in rs]
        summary[name] = {
            "dp_cpu_ms_per_example_median": 1000 * statistics.median(r["dp"] for r in rs),
            "nonprivate_cpu_ms_per_example_median": 1000
            * statistics.median(r["nonprivate"] for r in rs),
            "overhead_median": statistics.median(over),
            "overhead_min": min(over),
            "overhead_max": max(over),
            "overhead_per_round": over,
            # the per-step gradient check, as a share of the non-private cost per example
            "gradient_check_median": statistics.median(
                (r["dp"] - r["dp_no_check"]) / r["nonprivate"] for r in rs
            ),
        }
    result = {
        "command": " ".join(["python benchmarks/engine_overhead.py", *sys.argv[1:]]),
        "rounds": args.rounds,
        "rounds_done": done,
        "steps_per_arm_per_round": args.steps,
        "expected_batch_size": PER_RANK,
        "load_average_1min": loads,
        "cpus": os.cpu_count(),
        "sources": summary,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "engine_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(
        f"| {name} | {s['nonprivate_cpu_ms_per_example_median']:.3f} | "
        f"{s['dp_cpu_ms_per_example_median']:.3f} | {100 * s['overhead_median']:.1f}% "
        f"({100 * s['overhead_min']:.1f}% to {100 * s['overhead_max']:.1f}%) | "
        f"{100 * s['gradient_check_median']:.1f}% |"
        for name, s in summary.items()
    )
    load = ", ".join(f"{x:.1f}" for x in loads)
    md = f"""# The engine's overhead per example (one process)

Output of `{result["command"]}` ({done} of {args.rounds} rounds done). The tiny encoder of
`benchmarks/distributed.py` in one process (one thread), standing for one rank: DP-BiTFiT with
Poisson batches of expected size {PER_RANK} through the engine's loader, against non-private
bias-only training on fixed batches of {PER_RANK}. CPU (thread) time per example, medians over
the rounds, {args.steps} steps per arm each; each round is one worker process per source tree,
the arms alternating inside it. Overhead = DP / non-private - 1 per round: median (min to
max). Gradient check = (DP - DP without the check) / non-private per round, median (the
check runs on every physical batch by default). 1-minute load average at the start and after
each round: {load} ({os.cpu_count()} CPUs).

| engine | non-private CPU ms/example | DP-BiTFiT CPU ms/example | overhead | gradient check |
|---|---|---|---|---|
{rows}
"""
    (RESULTS / "engine_overhead.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

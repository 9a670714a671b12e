"""The engine's own cost per example, in one process: DP-BiTFiT against non-private bias-only
training of the same model, as CPU time per example (what waiting for a shared core does not
inflate), optionally for an older revision of the engine side by side in the same run.

    PYTHONPATH=src python benchmarks/engine_overhead.py [--model tiny|minilm] [--baseline REV]
        [--rounds 6 --steps 8]

`--model tiny` (default): one process stands for one rank of benchmarks/distributed.py, its tiny
encoder (d=128, seq 32). `--model minilm`: the bundled all-MiniLM-L6-v2 classifier as dpfit
loads it (biases + the new head, train mode), on the bundled Rotten Tomatoes texts, every
example `--max-length` tokens (128, the default maximum; shorter texts padded). DP-BiTFiT draws
Poisson batches of expected size 32 through the engine's loader; non-private bias-only training
draws shuffled batches of 32 through a torch DataLoader with the same collate function, so both
arms do the same data work. DP-BiTFiT runs once more without the per-step gradient check
(`check_gradients=False`) to show what that check costs. Each round runs one worker process
per source tree (order flipped every round); inside a worker the arms alternate step by step.
`--baseline REV` extracts `src/` of that git revision into a temporary folder and measures it
the same way. Writes benchmarks/results/engine_overhead[_MODEL].{json,md} (no suffix for tiny).
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
sys.path.insert(0, str(ROOT / "benchmarks"))  # the shared workloads, when imported from elsewhere
from harness.workers import last_json_line  # noqa: E402
from workloads import MINILM_MAX_LENGTH, Workload, minilm_workload  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PER_RANK = 32  # one rank's expected share of distributed.py's logical batch of 64
PHYS = 48  # physical batch cap: almost every Poisson batch of expected size 32 is one pass
MODELS = {
    "tiny": "the tiny encoder of `benchmarks/distributed.py` (2 layers, d=128, seq 32)",
    "minilm": "the bundled all-MiniLM-L6-v2 classifier (6 layers, d=384, biases + head)",
}


def tiny_workload() -> Workload:
    import distributed as bench  # the same model and data

    return bench.toy_workload()


def worker(steps: int, model_name: str, max_length: int) -> dict:
    """CPU seconds per example of each arm, alternating step by step."""
    import torch

    import dpfit

    torch.set_num_threads(1)
    job = tiny_workload() if model_name == "tiny" else minilm_workload(max_length)
    n_data = len(job.data)

    def forever(loader):  # a new pass when one ends (the DataLoader reshuffles)
        while True:
            yield from loader

    def dp_arm(**kw: bool) -> Callable[[], int]:
        model = job.make_model()
        engine = dpfit.PrivacyEngine(
            model, expected_batch_size=PER_RANK, sample_size=n_data, noise_multiplier=1.0, **kw
        )
        opt = torch.optim.SGD(engine.parameters(), lr=0.01)
        # older revisions (--baseline) have no optimizer= (empty batches, rare here, step late)
        takes_optimizer = "optimizer" in inspect.signature(engine.data_loader).parameters
        extra = {"optimizer": opt} if takes_optimizer else {}
        loader = engine.data_loader(job.data, job.collate, physical_batch_size=PHYS, **extra)
        batches = forever(loader)

        def step() -> int:
            n = 0
            while True:
                batch = next(batches)
                job.loss(model, batch).backward()
                n += job.rows(batch)
                if engine.step(opt):
                    return n

        return step

    np_model = job.make_model()
    np_opt = torch.optim.SGD([p for p in np_model.parameters() if p.requires_grad], lr=0.01)
    np_loader = torch.utils.data.DataLoader(
        job.data,
        batch_size=PER_RANK,
        shuffle=True,
        drop_last=True,
        collate_fn=job.collate,
        generator=torch.Generator().manual_seed(0),
    )
    np_batches = forever(np_loader)

    def np_step() -> int:
        batch = next(np_batches)
        job.loss(np_model, batch).backward()
        np_opt.step()
        np_opt.zero_grad()
        return job.rows(batch)

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


def run_worker(src: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--worker", str(args.steps), "--model", args.model,
         "--max-length", str(args.max_length)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return last_json_line(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument(
        "--max-length", type=int, default=MINILM_MAX_LENGTH, help="minilm: tokens per example"
    )
    ap.add_argument("--baseline", help="git revision whose engine to measure side by side")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8, help="steps per arm per worker")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.model, args.max_length)))
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
                res = run_worker(sources[name], args)
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
        "model": args.model,
        "max_length": args.max_length if args.model == "minilm" else None,
        "expected_batch_size": PER_RANK,
        "load_average_1min": loads,
        "cpus": os.cpu_count(),
        "sources": summary,
    }
    RESULTS.mkdir(exist_ok=True)
    stem = "engine_overhead" if args.model == "tiny" else f"engine_overhead_{args.model}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = "\n".join(
        f"| {name} | {s['nonprivate_cpu_ms_per_example_median']:.3f} | "
        f"{s['dp_cpu_ms_per_example_median']:.3f} | {100 * s['overhead_median']:.1f}% "
        f"({100 * s['overhead_min']:.1f}% to {100 * s['overhead_max']:.1f}%) | "
        f"{100 * s['gradient_check_median']:.1f}% |"
        for name, s in summary.items()
    )
    load = ", ".join(f"{x:.1f}" for x in loads)
    what = MODELS[args.model]
    if args.model == "minilm":
        what += f", every example {args.max_length} tokens (bundled Rotten Tomatoes texts, padded)"
    md = f"""# The engine's overhead per example (one process)

Output of `{result["command"]}` ({done} of {args.rounds} rounds done). Model: {what}, in
one process (one thread). DP-BiTFiT with Poisson batches of expected size {PER_RANK} through the
engine's loader, against non-private bias-only training on shuffled batches of {PER_RANK}
through a torch DataLoader with the same collate function. CPU (thread) time per example, medians over
the rounds, {args.steps} steps per arm each; each round is one worker process per source tree,
the arms alternating inside it. Overhead = DP / non-private - 1 per round: median (min to
max). Gradient check = (DP - DP without the check) / non-private per round, median (the
check runs on every physical batch by default). 1-minute load average at the start and after
each round: {load} ({os.cpu_count()} CPUs).

| engine | non-private CPU ms/example | DP-BiTFiT CPU ms/example | overhead | gradient check |
|---|---|---|---|---|
{rows}
"""
    (RESULTS / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

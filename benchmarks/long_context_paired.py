"""DP-BiTFiT's time over non-private bias-only training at long T, paired step by step in one
process.

Question: is DP-BiTFiT's time per step within 5% of non-private bias-only training at
T = 256-1024, batch 1 and 4 on SmolLM2-135M? benchmarks/long_context.py answers it with one
process per arm, run one after the other: at 40 CPU-seconds a step, three timed steps per arm
and a machine whose speed drifts between the two processes, one setting's ratio moves by as
much as the target allows. Here both arms live in one process (two copies of the model,
built and set up exactly as long_context.py's `nonpriv-bias` and `dp-bitfit` arms), and each
round runs one step of each, the order flipped every round, so that both arms of a pair meet
the same machine. Each (T, batch) gets its own process, on one thread.

    PYTHONPATH=src python benchmarks/long_context_paired.py \
        [--lengths 256 512 1024] [--batches 1 4] [--warmup 2] [--rounds 5]

Reported per (T, batch): each arm's median CPU seconds per step (the thread's own CPU time,
which a shared core inflates less than wall time), the median of the per-round ratios
DP / non-private with its smallest and largest, and the target (median ratio <= 1.05).
Beside them, per step and arm: the kernel's share of that CPU time and the page faults. At
T = 1024, batch 4, a step faults in about 5 GB of fresh pages (glibc maps every block above
its mmap threshold, such as the logits, anew and unmaps it when freed), and the kernel time
that costs moves by seconds from step to step with the machine's load, in both arms alike;
the ratio of user CPU time leaves that out. `--malloc keep` runs the process with glibc's
mmap off and its trimming off (MALLOC_MMAP_MAX_=0, MALLOC_TRIM_THRESHOLD_), so freed blocks
are reused and the faults stop after the first steps: the engine's own cost without the
allocator's. Writes benchmarks/results/long_context_paired.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import long_context  # noqa: E402  (the arms, exactly as the memory benchmark builds them)
from harness.workers import last_json_line  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ARMS = ("nonpriv-bias", "dp-bitfit")
TARGET = 1.05
MAX_ROUNDS = 400


def child(spec: dict) -> dict:
    """Both arms at one (T, batch), alternating step by step."""
    import torch

    torch.set_num_threads(1)
    steps = {}
    for arm in ARMS:
        model = long_context.build_model(spec["model"], arm)
        steps[arm] = long_context.setup_arm(arm, model, spec["batch"])
        vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(spec["length"])
    ids = torch.randint(3, vocab, (spec["batch"], spec["length"]), generator=g)
    cpu: dict[str, list[float]] = {arm: [] for arm in ARMS}
    wall: dict[str, list[float]] = {arm: [] for arm in ARMS}
    user: dict[str, list[float]] = {arm: [] for arm in ARMS}
    faults: dict[str, list[int]] = {arm: [] for arm in ARMS}
    r = 0
    while r < spec["warmup"] + spec["rounds"] or (
        sum(cpu["dp-bitfit"]) < spec["min_timed_s"] and r < MAX_ROUNDS
    ):
        order = ARMS if r % 2 == 0 else ARMS[::-1]
        for arm in order:
            u0, c0, w0 = _thread_usage(), time.thread_time(), time.perf_counter()
            steps[arm](ids)
            u1, c1, w1 = _thread_usage(), time.thread_time(), time.perf_counter()
            if r >= spec["warmup"]:
                cpu[arm].append(c1 - c0)
                wall[arm].append(w1 - w0)
                user[arm].append(u1.ru_utime - u0.ru_utime)
                faults[arm].append(u1.ru_minflt - u0.ru_minflt)
        r += 1
    return {"cpu_s": cpu, "wall_s": wall, "user_s": user, "minor_faults": faults}


def _thread_usage():
    """This thread's user time and page faults (Linux; the whole process elsewhere)."""
    import resource

    who = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)
    return resource.getrusage(who)


# glibc's malloc without mmap and without trimming: freed blocks stay in the heap for reuse
KEEP_FREED = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
MALLOC = {"default": {}, "keep": KEEP_FREED}


def run_setting(
    model: str,
    length: int,
    batch: int,
    warmup: int,
    rounds: int,
    min_timed_s: float,
    malloc: str = "default",
) -> dict:
    spec = {"model": model, "length": length, "batch": batch, "warmup": warmup, "rounds": rounds}
    spec["min_timed_s"] = min_timed_s
    env = {**os.environ, "OMP_NUM_THREADS": "1", **MALLOC[malloc]}
    load = os.getloadavg()[0]
    out = subprocess.run(
        [sys.executable, __file__, "--_child", json.dumps(spec)],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    res = last_json_line(out.stdout)
    dp, nonpriv = res["cpu_s"]["dp-bitfit"], res["cpu_s"]["nonpriv-bias"]
    ratios = [d / n for d, n in zip(dp, nonpriv, strict=True)]
    # getrusage splits a thread's time by sampled ticks: a step shorter than a tick may read 0
    user = res["user_s"]
    user_ratios = [
        d / n for d, n in zip(user["dp-bitfit"], user["nonpriv-bias"], strict=True) if n > 0
    ]
    return {
        **spec,
        **res,
        "malloc": malloc,
        "user_ratio_median": statistics.median(user_ratios) if user_ratios else None,
        "median_kernel_s": {
            arm: statistics.median(
                c - u for c, u in zip(res["cpu_s"][arm], res["user_s"][arm], strict=True)
            )
            for arm in ARMS
        },
        "median_minor_faults": {arm: statistics.median(res["minor_faults"][arm]) for arm in ARMS},
        "load_before": load,
        "median_cpu_s": {arm: statistics.median(res["cpu_s"][arm]) for arm in ARMS},
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratios": ratios,
        "ratio_of_medians": statistics.median(dp) / statistics.median(nonpriv),
    }


def render(res: dict) -> str:
    runs = res.get("runs", [res["command"]])
    lines = [
        "# DP-BiTFiT / non-private bias-only time at long T, paired step by step",
        "",
        *(
            [f"Command: `{res['command']}`"]
            if len(runs) == 1
            else [
                "Commands (each row says which run measured it; a later run's row replaces "
                "an earlier one's):",
                "",
                *[f"- run {i}: `{c}`" for i, c in enumerate(runs, 1)],
            ]
        ),  # fmt: skip
        "",
        f"Model: {res['model']} (causal LM, float32, SDPA), random token ids, no padding, one "
        "thread; both arms in one process, as benchmarks/long_context.py builds them "
        "(`nonpriv-bias`, `dp-bitfit`: PrivacyEngine mode bias, sigma 1, AdamW); "
        f"{res['warmup']} warm-up rounds, then timed rounds of one step per arm, the order "
        "flipped every round: at least --rounds, and more until DP-BiTFiT's timed steps add "
        "up to --min-timed-s CPU seconds. CPU seconds of the thread per step (user + kernel). "
        "Allocator: `default` is glibc's; `keep` turns its mmap and trimming off, so freed "
        "blocks are reused (the module docstring says why). Kernel s and page faults: the "
        "medians per step, non-private / DP (rows from before they were recorded show -).",
        "",
        "| T | batch | allocator | run | timed rounds | non-private bias-only, CPU s/step "
        "| DP-BiTFiT, CPU s/step | DP / non-private per round: median [min, max] "
        "| ratio of the medians | user CPU only: median ratio | kernel s/step | page faults "
        "per step (thousands) | load before |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in res["settings"]:
        m = s["median_cpu_s"]
        lines.append(
            f"| {s['length']} | {s['batch']} | {s.get('malloc', 'default')} | {s.get('run', 1)} "
            f"| {len(s['ratios'])} | {m['nonpriv-bias']:.2f} | {m['dp-bitfit']:.2f} | "
            f"{s['ratio_median']:.3f} [{s['ratio_min']:.3f}, {s['ratio_max']:.3f}] | "
            f"{s['ratio_of_medians']:.3f} | {_user_cells(s)} | {s['load_before']:.1f} |"
        )
    lines.append("")
    for malloc in sorted({s.get("malloc", "default") for s in res["settings"]}):
        rows = [s for s in res["settings"] if s.get("malloc", "default") == malloc]
        worst = max(rows, key=lambda s: s["ratio_median"])
        verdict = "met" if worst["ratio_median"] <= TARGET else "NOT met"
        lines.append(
            f"Target: DP-BiTFiT / non-private bias-only time <= {TARGET} at every setting "
            f"(median of the paired rounds), allocator `{malloc}`: largest "
            f"{worst['ratio_median']:.3f} at T={worst['length']}, batch {worst['batch']}: "
            f"{verdict}."
        )
        lines.append("")
    return "\n".join(lines)


def _user_cells(s: dict) -> str:
    if s.get("user_ratio_median") is None:  # recorded before these columns, or no ticks
        return "- | - | -"
    k, f = s["median_kernel_s"], s["median_minor_faults"]
    return (
        f"{s['user_ratio_median']:.3f} | {k['nonpriv-bias']:.2f} / {k['dp-bitfit']:.2f} | "
        f"{f['nonpriv-bias'] / 1e3:.0f} / {f['dp-bitfit'] / 1e3:.0f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, at least")
    ap.add_argument(
        "--min-timed-s",
        type=float,
        default=60.0,
        help="more rounds until DP-BiTFiT's timed steps add up to this many CPU seconds "
        "(short steps are noisier)",
    )
    ap.add_argument(
        "--malloc",
        choices=tuple(MALLOC),
        default="default",
        help="glibc's allocator as it is, or with mmap and trimming off (freed blocks reused)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "long_context_paired")
    ap.add_argument(
        "--merge",
        type=Path,
        help="an earlier result JSON: keep its settings, replacing those this run measures",
    )
    ap.add_argument("--_child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._child:
        print(json.dumps(child(json.loads(args._child))))
        return 0
    command = "PYTHONPATH=src python benchmarks/long_context_paired.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    res = {
        "command": command.strip(),
        "model": args.model,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "min_timed_s": args.min_timed_s,
        "settings": [],
    }
    if args.merge:
        old = json.loads(args.merge.read_text())
        res["runs"] = [*old.get("runs", [old["command"]]), res["command"]]
        res["settings"] = [{"run": 1, **x} for x in old["settings"]]
    run = len(res.get("runs", [None]))
    for batch in args.batches:
        for length in args.lengths:
            s = run_setting(
                args.model, length, batch, args.warmup, args.rounds, args.min_timed_s, args.malloc
            )
            s["run"] = run
            key = (length, batch, args.malloc)
            res["settings"] = [x for x in res["settings"] if _key(x) != key]
            res["settings"].append(s)
            res["settings"].sort(key=lambda x: (x["batch"], x["length"], x.get("malloc", "")))
            print(
                f"T={length} b={batch}: DP / non-private {s['ratio_median']:.3f} "
                f"[{s['ratio_min']:.3f}, {s['ratio_max']:.3f}]",
                flush=True,
            )
            args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
            args.out.with_suffix(".md").write_text(render(res))
    return 0


def _key(s: dict) -> tuple[int, int, str]:
    return s["length"], s["batch"], s.get("malloc", "default")


if __name__ == "__main__":
    raise SystemExit(main())

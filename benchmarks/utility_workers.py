"""The utility suite as several `utility.py` processes sharing one machine (an accelerator).

One run of the suite is small for a GPU: most of its time is Python, tokenising and the host
side of each step, so several suite processes share one device well. Each worker runs
`utility.py` on its own slice of (tasks, rows, seeds) with its own log; this script merges the
workers' logs into one (`{tag}_runs.jsonl` in --out) every few seconds and at the end, so what
has finished is kept even when the whole job is stopped at a deadline. Rebuild the tables from
the merged log with `utility.py --tag TAG --table-only`.

    python benchmarks/utility_workers.py --out /tmp/gpu --tag utility_gpu --deadline-s 500 \\
        --slice rotten-tomatoes:dp-8,dp-lora-8:0,1,2 --slice text-source:np-full:0,1,2

A slice is TASKS:ROWS:SEEDS, each comma-separated (utility.py's names).

`results/utility_gpu_runs.jsonl` came from two such jobs on one NVIDIA H200 (torch
2.11.0+cu130, transformers 5.24.0, peft 0.21.2, dp-accounting 0.6.0; the bundled MiniLM's
weights checked by SHA-256), each merged log appended to the committed one, with
RT=rotten-tomatoes TS=text-source CP=convention-party HO=headline-month,debate-role:

    # job 1, --deadline-s 550 (11 workers): every LoRA run in it failed in the benchmark's own
    # phase_record (peft's renamed weights), fixed before job 2; the failures stay in the log
    --slice $RT:dp-8,dp-bias-lora-8,dp-lora-8:0,1,2 (the same for $TS and $CP)
    --slice $RT:np-full:0,1,2 (the same for $TS and $CP)
    --slice $RT,$TS,$CP:dp-bias-lora-1,dp-1:0  --slice $RT,$TS,$CP:np-bias:0,1,2
    --slice $RT,$TS,$CP:dp-full-8:0,1,2  --slice $HO:dp-bias-lora-8,dp-lora-8:0,1,2
    --slice $HO:dp-8,np-bias:0,1,2
    # job 2, --deadline-s 225 (13 workers, all finished in 171 s)
    --slice T:dp-bias-lora-8:0,1,2 and --slice T:dp-lora-8:0,1,2 for T in RT, TS, CP and
    each held-out task; --slice T:dp-bias-lora-1:0 for T in RT, TS, CP
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_slice(text: str) -> list[str]:
    """utility.py arguments for one TASKS:ROWS:SEEDS slice."""
    try:
        tasks, rows, seeds = text.split(":")
    except ValueError:
        raise argparse.ArgumentTypeError(f"a slice is TASKS:ROWS:SEEDS, got {text!r}") from None
    parts = [tasks.split(","), rows.split(","), seeds.split(",")]
    if not all(all(names) for names in parts):
        raise argparse.ArgumentTypeError(f"empty name in slice {text!r}")
    return ["--tasks", *parts[0], "--rows", *parts[1], "--seeds", *parts[2]]


def merge(logs: list[Path], into: Path) -> int:
    """Write every finished line of the workers' logs into one file (atomically)."""
    lines = []
    for log in logs:
        if log.exists():
            text = log.read_text()
            lines += [line for line in text.splitlines(keepends=True) if line.endswith("\n")]
    tmp = into.with_suffix(".tmp")
    tmp.write_text("".join(lines))
    tmp.replace(into)
    return len(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--slice", type=parse_slice, action="append", required=True)
    p.add_argument("--out", type=Path, required=True, help="the merged log's folder")
    p.add_argument("--work", type=Path, default=None, help="workers' folders (default: OUT/work)")
    p.add_argument("--tag", default="utility_gpu")
    p.add_argument("--deadline-s", type=float, default=None, help="stop the workers after this")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per worker")
    p.add_argument("--utility-args", default="", help="more utility.py arguments, e.g. --quick")
    args = p.parse_args(argv)
    work = args.work or args.out / "work"
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    procs, logs, outs = [], [], []
    for i, extra in enumerate(args.slice):
        folder = work / f"w{i}"
        folder.mkdir(parents=True, exist_ok=True)
        tag = f"{args.tag}_w{i}"
        logs.append(folder / f"{tag}_runs.jsonl")
        cmd = [sys.executable, str(HERE / "utility.py"), "--out", str(folder), "--tag", tag]
        out = open(folder / "stderr.log", "w")  # open while the worker runs
        outs.append(out)
        procs.append(
            subprocess.Popen(
                cmd + extra + args.utility_args.split(),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        )
        print(f"worker {i}: {' '.join(extra)}", flush=True)
    merged = args.out / f"{args.tag}_runs.jsonl"
    start, n = time.monotonic(), 0
    while any(pr.poll() is None for pr in procs):
        if args.deadline_s is not None and time.monotonic() - start > args.deadline_s:
            for pr in procs:
                pr.terminate()
            print("deadline: workers stopped", flush=True)
            break
        time.sleep(5)
        n, before = merge(logs, merged), n
        if n != before:
            print(f"{time.monotonic() - start:.0f} s: {n} records", flush=True)
    for pr, out in zip(procs, outs, strict=True):
        pr.wait()
        out.close()
    n = merge(logs, merged)
    codes = [pr.returncode for pr in procs]
    print(f"merged {n} records into {merged}; worker exit codes {codes}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

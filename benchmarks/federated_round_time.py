"""Seconds per federated round with clients that fine-tune the model, on this machine.

Runs ``dpfit federated`` exactly as the CLI builds it (its argument parser and ``configs``),
for BiTFiT clients of the bundled MiniLM and LoRA clients of the bundled SmolLM2-135M, on
the in-process engine and on Flower's simulation engine (Ray), and times each round from the
server's per-round callback. Round 1 also pays for loading the model in every process that
runs clients (the Ray workers); later rounds are the steady cost. The default settings are
the CLI's (20 clients, 5 expected per round, 32 examples per client, sequences cut at 48
tokens, 200 server validation examples per round) with the ``fixed`` rule: every rule's round
costs about the same (DP-CLAC adds one client-side evaluation, DP-LAC a one-off vote before
round 1 in which every client trains once and evaluates three candidates).

    python benchmarks/federated_round_time.py                      # all four rows, ~30 min
    python benchmarks/federated_round_time.py --rows minilm-bias-local --rounds 2
    # the batched engine against its version at a git commit, alternated in one process
    python benchmarks/federated_round_time.py --against-ref bf92cf1 --rounds 5

Client sampling is seeded (``--insecure-reproducible-noise``) so that every row samples the
same clients: times compare the same work. The machine's load average is recorded next to
each row, since other jobs on shared cores slow every row.

Writes benchmarks/results/federated_round_time.{json,md} and the table between the markers in
docs/federated.md; ``--from-json`` re-renders both from the recorded runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from harness.render import write_between_markers

RESULTS = Path(__file__).parent / "results"
DOCS = Path(__file__).parent.parent / "docs" / "federated.md"
MARKERS = ("<!-- federated_round_time:begin -->", "<!-- federated_round_time:end -->")

# the DP-LAC protocol's setting: 100 of 1,000 clients of 10 examples a round, two local epochs, LoRA on
# the top layer (+ its biases and the head); the batched engine against the per-client path
PROTOCOL = (
    "--clients", "1000", "--clients-per-round", "100", "--examples-per-client", "10",
    "--local-epochs", "2",
)  # fmt: skip
ROWS = {
    "minilm-bias-local": ("minilm", "bias", "local", ()),
    "minilm-bias-simulation": ("minilm", "bias", "simulation", ()),
    "smollm2-lora-local": ("smollm2", "lora", "local", ()),
    "smollm2-lora-simulation": ("smollm2", "lora", "simulation", ()),
    "minilm-loratop-local": ("minilm", "lora-top", "local", PROTOCOL),
    "minilm-loratop-batched": ("minilm", "lora-top", "batched", PROTOCOL),
}


def run_row(name: str, args: argparse.Namespace) -> dict:
    from dpfit.federated.app import run_local, run_simulation
    from dpfit.federated.cli import add_arguments, configs
    from dpfit.federated.client import load_local_model

    model, mode, engine, row_flags = ROWS[name]
    argv = [
        "--model", model, "--local-mode", mode, "--engine", engine,
        "--method", "fixed", "--noise-multiplier", "1.0", "--initial-clip", "1.0",
        "--rounds", str(args.rounds), "--num-cpus", str(args.num_cpus),
        "--insecure-reproducible-noise", *row_flags, *args.extra,
    ]  # fmt: skip
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cli_args = parser.parse_args(argv)
    server_cfg, task = configs(cli_args)
    lm = load_local_model(task.model, task.local_mode, task.lora_r, task.seed)  # here: setup
    trainable = sum(a.size for a in lm.initial)
    stamps: list[float] = []
    cpu: list[float] = []
    load_before = os.getloadavg()[0]

    def on_round(record) -> None:
        stamps.append(time.perf_counter())
        cpu.append(cpu_seconds())

    t0, c0 = time.perf_counter(), cpu_seconds()
    if engine == "local":
        run_local(server_cfg, task, on_round=on_round)
    elif engine == "batched":
        from dpfit.federated.batched import run_batched

        run_batched(server_cfg, task, on_round=on_round)
    else:
        run_simulation(server_cfg, task, on_round=on_round, num_cpus=args.num_cpus)
    total = time.perf_counter() - t0
    rounds = [b - a for a, b in zip([t0, *stamps[:-1]], stamps, strict=True)]
    cpu_rounds = [b - a for a, b in zip([c0, *cpu[:-1]], cpu, strict=True)]
    steady = rounds[1:] or rounds
    cpu_steady = cpu_rounds[1:] or cpu_rounds
    return {
        "row": name,
        "model": model,
        "local_mode": mode,
        "engine": engine,
        "trainable_values": int(trainable),
        "rounds": len(rounds),
        "first_round_s": rounds[0],
        "steady_round_s": statistics.mean(steady),
        "round_s": rounds,
        "first_round_cpu_s": cpu_rounds[0],
        "steady_round_cpu_s": statistics.mean(cpu_steady),
        "round_cpu_s": cpu_rounds,
        "clients_sampled": sampled_counts(server_cfg, len(rounds)),
        "total_s": total,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg()[0],
        "argv": argv,
        "row_flags": list(row_flags),
    }


def engine_at(ref: str):
    """``dpfit.federated.batched`` as it was at git commit ``ref`` (the previous engine),
    loaded as its own module beside the current one."""
    import importlib.util
    import subprocess
    import tempfile

    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{ref}:src/dpfit/federated/batched.py"],
        cwd=root, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "batched_at_ref.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("batched_at_ref", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def side_by_side(args: argparse.Namespace) -> dict:
    """CPU seconds of a protocol round (the sampled clients' local training, then the
    server's validation loss) with the current batched engine and the one at ``--against-ref``,
    the two arms alternated round by round on the same sampled clients, in this process."""
    import numpy as np
    import torch

    from dpfit.federated import batched
    from dpfit.federated.app import client_examples, eval_split, initial_arrays
    from dpfit.federated.cli import add_arguments, configs
    from dpfit.federated.client import load_local_model

    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--model", "minilm", "--local-mode", "lora-top", "--engine", "batched",
            *PROTOCOL, "--eval-examples", str(args.eval_examples)]  # fmt: skip
    server_cfg, task = configs(parser.parse_args(argv))
    lm = load_local_model(task.model, task.local_mode, task.lora_r, task.seed)
    data = lambda p: client_examples(task, p)  # noqa: E731
    arms = {"current": batched.BatchedClients(lm, task, data)}
    arms[args.against_ref] = engine_at(args.against_ref).BatchedClients(lm, task, data)
    rng = np.random.default_rng(0)
    sampled = [
        np.flatnonzero(rng.random(task.num_clients) < server_cfg.sample_rate).tolist()
        for _ in range(args.rounds)
    ]
    store = arms["current"].cache.store
    arms["current"].cache.fill([e.text for pids in sampled for p in pids for e in data(p)])
    arms[args.against_ref].cache.store = store  # the same frozen-layer output for both
    val = eval_split(task, "validation")
    evals = {name: engine.evaluate_fn(*val) for name, engine in arms.items()}
    start = initial_arrays(task)
    cpu: dict[str, list[float]] = {name: [] for name in arms}
    for r, pids in enumerate(sampled):
        for name in arms if r % 2 == 0 else reversed(list(arms)):
            c0 = time.process_time()
            arms[name].round_replies(start, pids, r + 1)
            evals[name](start)
            cpu[name].append(time.process_time() - c0)
    ref = statistics.median(cpu[args.against_ref])
    return {
        "against_ref": args.against_ref,
        "rounds": args.rounds,
        "eval_examples": len(val[0]),
        "argv": argv,
        "cpu_s": cpu,
        "median_cpu_s": {name: statistics.median(v) for name, v in cpu.items()},
        "ratio": statistics.median(cpu["current"]) / ref,
        "command": f"python benchmarks/federated_round_time.py --against-ref {args.against_ref} "
        f"--rounds {args.rounds} --eval-examples {args.eval_examples}",
    }


def render_side_by_side(sbs: dict) -> list[str]:
    med = sbs["median_cpu_s"]
    lines = [
        "",
        f"## The batched engine against its version at {sbs['against_ref']} (protocol round)",
        "",
        f"One DP-LAC protocol round (`{' '.join(PROTOCOL)}`, lora-top MiniLM): the sampled "
        f"clients' local training, then the server's loss on {sbs['eval_examples']} validation "
        f"examples; the two engines alternated round by round on the same sampled clients, in "
        f"one process, one thread, {sbs['rounds']} rounds each. Command: `{sbs['command']}`.",
        "",
        "| engine | CPU s per round, median | CPU s per round, each |",
        "|---|---|---|",
    ]
    for name, values in sbs["cpu_s"].items():
        label = "current" if name == "current" else f"at {name}"
        each = ", ".join(f"{v:.2f}" for v in values)
        lines.append(f"| {label} | {med[name]:.2f} | {each} |")
    lines += ["", f"Current / previous: {sbs['ratio']:.2f} (ratio of the medians)."]
    return lines


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and every live descendant (Ray's workers)."""
    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        try:
            total += sum(child.cpu_times()[:2])
        except psutil.Error:  # exited between listing and reading
            pass
    return total


def sampled_counts(server_cfg, rounds: int) -> list[int]:
    """Clients the server samples in each round: its sampling stream, replayed from the
    (insecure, benchmark-only) seed; the vote, if any, draws no sampling decisions."""
    from dpfit.federated.strategy import server_generators

    rng, _ = server_generators(server_cfg.insecure_seed)
    q = server_cfg.sample_rate
    return [int((rng.random(server_cfg.num_clients) < q).sum()) for _ in range(rounds)]


def render(data: dict) -> str:
    s = data["setup"]
    lines = [
        "# Seconds per federated round (clients fine-tune the model)",
        "",
        f"Machine: {s['cpus']} CPUs ({s['platform']}), torch {s['torch']}, shared with other "
        "jobs (load average recorded per row). Settings: the CLI's defaults, `--method fixed "
        f"--noise-multiplier 1`, `--num-cpus {s['num_cpus']}` "
        "(simulation: that many single-thread Ray workers; local: one client at a time, "
        "single-threaded).",
        "",
        "| model | local mode | engine | trainable values | round 1: wall s (CPU s) | "
        "later rounds: wall s (CPU s), mean | rounds | clients per round | load avg |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        sampled = ", ".join(str(c) for c in r["clients_sampled"]) or "-"
        lines.append(
            f"| {r['model']} | {r['local_mode']} | {r['engine']} | {r['trainable_values']:,} "
            f"| {r['first_round_s']:.0f} ({r['first_round_cpu_s']:.0f}) "
            f"| {r['steady_round_s']:.0f} ({r['steady_round_cpu_s']:.0f}) | {r['rounds']} "
            f"| {sampled} "
            f"| {r['load_avg_before']:.1f} -> {r['load_avg_after']:.1f} |"
        )
    flagged = {" ".join(r.get("row_flags", [])) for r in data["rows"]} - {""}
    for flags in sorted(flagged):
        names = [
            f"{r['local_mode']}/{r['engine']}"
            for r in data["rows"]
            if " ".join(r.get("row_flags", [])) == flags
        ]
        lines += ["", f"Rows {', '.join(names)}: the defaults with `{flags}`."]
    lines += [
        "",
        "Batched engine: all of a round's sampled clients as one computation, the frozen "
        "lower layers computed once per example and cached (round 1 includes filling that "
        "cache for every client's examples and the validation examples; later rounds are "
        "the steady cost, the one to set against the per-client path's).",
        "",
        "Wall seconds are what a user waits on this shared machine; CPU seconds (this process "
        "and its Ray workers, user + system) are much less sensitive to other jobs: on an idle "
        "machine a round takes about its CPU s on the local engine, and between CPU s / "
        f"{s['num_cpus']} and CPU s on the simulation engine (clients in parallel, the "
        "server's evaluation not). Round 1 of the simulation engine includes starting Ray and "
        "loading the model in each worker.",
        "",
        "A round: the sampled clients each train one local epoch on their examples, the "
        "server clips, noises and averages, then evaluates the new model on its validation "
        "examples. Command(s): `" + s["command"] + "`.",
        "",
    ]
    if "side_by_side" in data:
        lines += render_side_by_side(data["side_by_side"]) + [""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument(
        "--against-ref",
        default=None,
        help="time the batched engine against its version at this git commit instead (kept "
        "beside the recorded rows)",
    )
    p.add_argument("--eval-examples", type=int, default=600, help="--against-ref only")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more CLI flags")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument(
        "--from-json", type=Path, nargs="+", default=None, help="recorded runs (rows merged)"
    )
    p.add_argument(
        "--docs", type=Path, default=DOCS, help="also write the table into this page's markers"
    )
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.against_ref:
        path = args.out / "federated_round_time.json"
        data = json.loads(path.read_text())
        data["side_by_side"] = side_by_side(args)
        path.write_text(json.dumps(data, indent=2))
    elif args.from_json:
        runs = [json.loads(f.read_text()) for f in args.from_json]
        data = {
            "setup": dict(
                runs[0]["setup"], command=" ; ".join(r["setup"]["command"] for r in runs)
            ),
            "rows": [row for r in runs for row in r["rows"]],
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "federated_round_time.json").write_text(json.dumps(data, indent=2))
    else:
        import torch

        data = {
            "setup": {
                "cpus": os.cpu_count(),
                "platform": platform.machine(),
                "torch": torch.__version__,
                "rounds": args.rounds,
                "num_cpus": args.num_cpus,
                "command": "python benchmarks/federated_round_time.py --rounds "
                f"{args.rounds} --num-cpus {args.num_cpus} --rows {' '.join(args.rows)}",
            },
            "rows": [],
        }
        for name in args.rows:
            row = run_row(name, args)
            print(json.dumps({k: v for k, v in row.items() if k != "argv"}), flush=True)
            data["rows"].append(row)
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "federated_round_time.json").write_text(json.dumps(data, indent=2))
    text = render(data)
    (args.out / "federated_round_time.md").write_text(text)
    if args.docs is not None:
        write_into_docs(text, args.docs)
    print(text)


def write_into_docs(text: str, docs: Path) -> None:
    """Replace the table between the markers in docs/federated.md with this rendering."""
    table = "\n".join(line for line in text.splitlines() if not line.startswith("# "))
    write_between_markers(docs, MARKERS, table.strip())


if __name__ == "__main__":
    main()

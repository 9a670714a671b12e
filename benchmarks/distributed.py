"""Data-parallel DP-BiTFiT on this machine: 1 process x 2 threads vs 2 processes x 1 thread
(gloo), against non-private DDP bias-only, and the bytes all-reduced per step (bias vs full).

    PYTHONPATH=src python benchmarks/distributed.py [--model tiny|larger|minilm]
        [--rounds 10 --steps 4]

Without --model: a tiny (2 layers, d=128, sequence 32) and a larger (d=256, sequence 128)
transformer encoder, the larger one for half the rounds and steps; writes
benchmarks/results/distributed.json and distributed.md. `--model NAME`: that model alone, for
the rounds and steps given; writes distributed_NAME.json/.md. `minilm` is the product's
default model: the bundled all-MiniLM-L6-v2 classifier as dpfit trains it (biases + the new
head, dropout on), every example 128 tokens of the bundled Rotten Tomatoes texts: the
workload of `engine_overhead.py --model minilm` (benchmarks/workloads.py). Examples/s is the
median over the measured logical steps of (examples in the step, all ranks) / (step wall time
on rank 0). The machine's CPUs are shared, so absolute figures are noisy; the ratios come
from one run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))  # the shared workloads, when imported from elsewhere
from workloads import MINILM_MAX_LENGTH, Workload, minilm_workload  # noqa: E402

# PHYS caps a rank's forward pass; a Poisson share of the logical batch (expected B/2 = 32 per
# rank, sd 5.7) exceeds 48 in about 0.3% of steps, so almost every step is one pass, as the
# non-private arm's fixed 32 per rank always is (a cap of 32 would split half the DP steps
# into a full and a tiny pass, whose fixed cost is not the cost of privacy).
# The same B and PHYS serve MiniLM: at 128 tokens it costs about 90 ms of CPU per example on
# one core (benchmarks/results/engine_overhead_minilm.md), so 32 examples per rank make a
# step of about 3 s on a quiet core (a few seconds: enough steps fit in minutes), and 32 per
# rank is the batch engine_overhead.py measures in one process, so the two figures compare.
# A smaller batch would shorten the run but inflate the share of the per-step fixed costs
# (noise, all-reduce, optimizer) beyond what a real run pays.
N, B, PHYS, VOCAB = 4096, 64, 48, 1000
# toy encoder size: set per job through the environment (main() runs a tiny and a larger one)
D, SEQ = int(os.environ.get("BENCH_D", "128")), int(os.environ.get("BENCH_SEQ", "32"))
SIZES = {"tiny": (128, 32), "larger": (256, 128)}
MODELS = ("tiny", "larger", "minilm")


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        layer = nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(x)).mean(1))


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, VOCAB, (N, SEQ), generator=g)
        self.y = torch.randint(0, 2, (N,), generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def make_model(mode: str) -> nn.Module:
    import dpfit

    torch.manual_seed(0)
    model = Encoder()
    if mode == "bias":
        dpfit.make_bias_trainable(model)
    return model


def toy_workload() -> Workload:
    """The toy encoder (size from the environment) on random tokens."""
    return Workload(
        make_model=lambda: make_model("bias"),
        data=Tokens(),
        collate=torch.utils.data.default_collate,  # what the engine's loader uses by default
        loss=lambda model, b: nn.functional.cross_entropy(model(b[0]), b[1]),
        rows=lambda b: len(b[0]),
    )


def describe(model: str) -> str:
    if model == "minilm":
        return (
            "bundled all-MiniLM-L6-v2 classifier, 6 layers, d=384, biases + head, "
            f"{MINILM_MAX_LENGTH} tokens per example (bundled Rotten Tomatoes texts, padded)"
        )
    d, seq = SIZES[model]
    return f"2-layer transformer encoder, d={d}, feed-forward {2 * d}, seq {seq}"


def trainable_bytes(model: nn.Module) -> dict[str, int]:
    """What the engine all-reduces per logical step (every trainable tensor, float32), and
    what full fine-tuning would (every parameter)."""
    return {
        "bias": 4 * sum(p.numel() for p in model.parameters() if p.requires_grad),
        "full": 4 * sum(p.numel() for p in model.parameters()),
    }


def bundled_model_bytes() -> dict | None:
    """The same count for the bundled MiniLM classifier (biases and head, as dpfit train
    trains it, vs everything)."""
    import dpfit
    from dpfit.models import load_classifier

    try:
        loaded = load_classifier(None, ["neg", "pos"], seed=0)
    except Exception as e:  # the bundled weights are an optional install
        print(f"bundled model unavailable: {e}")
        return None
    model = loaded.model
    full = 4 * sum(p.numel() for p in model.parameters())
    dpfit.make_bias_trainable(model, train_head=loaded.head_names)
    bias = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"bias": bias, "full": full, "bias_over_full": bias / full}


class DPArm:
    """DP-BiTFiT with the engine's Poisson loader: one logical step per `step()` call."""

    def __init__(self, world: int, job: Workload) -> None:
        import dpfit

        self.world, self.job = world, job
        self.model = job.make_model()
        self.engine = dpfit.PrivacyEngine(
            self.model, expected_batch_size=B, sample_size=len(job.data), noise_multiplier=1.0
        )
        self.opt = torch.optim.SGD(self.engine.parameters(), lr=0.01)
        loader = self.engine.data_loader(
            job.data, job.collate, physical_batch_size=PHYS, optimizer=self.opt
        )
        self.batches = self.forever(loader)

    @staticmethod
    def forever(loader):
        """A new pass when one ends (a pass is len(data) / B logical steps: 64 for the toy
        encoders, 160 for MiniLM's 10,233 texts; a long run needs more)."""
        while True:
            yield from loader

    def step(self) -> tuple[int, float, float]:
        """(examples in the logical step on all ranks, wall and CPU seconds on this rank)."""
        n, t, c = 0, time.perf_counter(), time.thread_time()
        while True:
            batch = next(self.batches)
            self.job.loss(self.model, batch).backward()
            n += self.job.rows(batch)
            if self.engine.step(self.opt):
                break
        dt, dc = time.perf_counter() - t, time.thread_time() - c
        total = torch.tensor([n])
        if self.world > 1:
            dist.all_reduce(total)  # examples in the step, all ranks (not timed)
        return int(total), dt, dc


class DDPArm:
    """Non-private DDP bias-only: B/W examples per rank per step, physical batches of PHYS
    (gradient accumulation under no_sync: DDP reduces the bias gradients once per step).
    Without DDP's buffer broadcast in every forward, which the DP arm does not do either (the
    engine refuses it) and which constant buffers (MiniLM's position ids) do not need."""

    def __init__(self, world: int, job: Workload) -> None:
        from dpfit.distributed import no_forward_buffer_sync

        self.world, self.job = world, job
        self.model = job.make_model()
        self.ddp = nn.parallel.DistributedDataParallel(self.model, **no_forward_buffer_sync())
        self.opt = torch.optim.SGD([p for p in self.model.parameters() if p.requires_grad], lr=0.01)
        self.rank, self.s = dist.get_rank(), 0

    def step(self) -> tuple[int, float, float]:
        per_rank, n = B // self.world, len(self.job.data)
        t, c = time.perf_counter(), time.thread_time()
        start = ((self.s * self.world + self.rank) * per_rank) % (n - per_rank)
        for i in range(0, per_rank, PHYS):
            chunk = range(start + i, start + min(i + PHYS, per_rank))
            batch = self.job.collate([self.job.data[j] for j in chunk])
            last = i + PHYS >= per_rank
            with self.ddp.no_sync() if not last else contextlib.nullcontext():
                self.job.loss(self.ddp, batch).backward()
        self.opt.step()
        self.opt.zero_grad()
        self.s += 1
        return B, time.perf_counter() - t, time.thread_time() - c


def worker(
    kind: str, model: str, rank: int, world: int, port: int, rounds: int, steps: int, out: Path
) -> None:
    """kind "interleaved": both arms in the same processes, alternating blocks of `steps`
    steps (the order flips every round) so that drift in the machine's load hits both;
    kind "dp": the DP arm alone (for 1 process x 2 threads)."""
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=600),
        )
    job = minilm_workload() if model == "minilm" else toy_workload()
    arms = {"dp": DPArm(world, job)}
    if kind == "interleaved":
        arms["ddp"] = DDPArm(world, job)
    for arm in arms.values():  # warm-up
        arm.step(), arm.step()
    res: dict = {name: [] for name in arms}
    for r in range(rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for name in order:
            res[name].append([arms[name].step() for _ in range(steps)])
    res["allreduce_bytes"] = trainable_bytes(arms["dp"].model)
    if rank == 0:
        out.write_text(json.dumps(res))
    if world > 1:
        dist.destroy_process_group()


def launch(kind: str, world: int, threads: int, rounds: int, steps: int, model: str) -> dict:
    out = RESULTS / f".distributed-{model}-{kind}-{world}.tmp.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d, seq = SIZES.get(model, SIZES["tiny"])  # the toy size (unused for minilm)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT / "src"),
           "BENCH_D": str(d), "BENCH_SEQ": str(seq)}  # fmt: skip
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                kind,
                model,
                str(r),
                str(world),
                str(port),
                str(rounds),
                str(steps),
                str(out),
            ],
            env=env,
        )  # fmt: skip
        for r in range(world)
    ]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"{model} {kind} x{world} failed")
    res = json.loads(out.read_text())
    out.unlink()
    return res


def summarise(blocks: list[list[tuple[int, float, float]]], world: int, threads: int) -> dict:
    steps = [s for b in blocks for s in b]
    rates = [n / t for n, t, _ in steps]
    return {
        "processes": world,
        "threads_per_process": threads,
        "steps_measured": len(steps),
        "examples_per_s_median": statistics.median(rates),
        "examples_per_s_min": min(rates),
        "examples_per_s_max": max(rates),
        "step_s_median": statistics.median(t for _, t, _ in steps),
        "cpu_s_per_example_median": statistics.median(c / n for n, _, c in steps),
    }


def block_rate(block: list[tuple[int, float, float]]) -> float:
    return statistics.median(n / t for n, t, _ in block)


def overhead(inter: dict, world: int) -> dict:
    """DP-BiTFiT against non-private DDP bias-only from one interleaved job: (non-private rate /
    DP rate) - 1 from the medians over every step, per round (adjacent blocks: their spread
    shows the noise), and from CPU seconds per example (what waiting for a core does not
    inflate)."""
    dp, ddp = summarise(inter["dp"], world, 1), summarise(inter["ddp"], world, 1)
    per_round = [
        block_rate(d) / block_rate(p) - 1 for p, d in zip(inter["dp"], inter["ddp"], strict=True)
    ]
    return {
        "dp_bitfit": dp,
        "nonprivate_ddp_bias": ddp,
        "overhead_wall_medians": ddp["examples_per_s_median"] / dp["examples_per_s_median"] - 1,
        "overhead_wall_per_round": {
            "median": statistics.median(per_round),
            "min": min(per_round),
            "max": max(per_round),
            "values": per_round,
        },
        "overhead_cpu": dp["cpu_s_per_example_median"] / ddp["cpu_s_per_example_median"] - 1,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODELS, help="this model alone (default: tiny and larger)")
    ap.add_argument("--rounds", type=int, default=10, help="blocks per arm (alternating)")
    ap.add_argument("--steps", type=int, default=4, help="logical steps per block")
    ap.add_argument("--worker", nargs=8, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, model, rank, world, port, rounds, steps, out = args.worker
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        worker(kind, model, int(rank), int(world), int(port), int(rounds), int(steps), Path(out))
        return
    if args.model is None:
        plan = {
            "tiny": (args.rounds, args.steps),
            "larger": (max(2, args.rounds // 2), max(2, args.steps // 2)),
        }
    else:
        plan = {args.model: (args.rounds, args.steps)}
    first = next(iter(plan))  # the model of the 1 process x 2 threads run and the byte count
    command = " ".join(["python benchmarks/distributed.py", *sys.argv[1:]])
    loads = [os.getloadavg()[0]]
    sizes = {}
    for model, (rounds, steps) in plan.items():
        inter = launch("interleaved", 2, 1, rounds, steps, model)
        loads.append(os.getloadavg()[0])
        if model == first:
            reduced = inter["allreduce_bytes"]
        sizes[model] = {
            "model": describe(model),
            "rounds": rounds,
            "steps_per_block": steps,
            **overhead(inter, 2),
        }
    one = summarise(launch("dp", 1, 2, max(2, args.rounds // 3), args.steps, first)["dp"], 1, 2)
    loads.append(os.getloadavg()[0])
    bias, full = reduced["bias"], reduced["full"]
    toy = args.model != "minilm"
    minilm = bundled_model_bytes() if args.model is None else None
    result = {
        "command": command,
        "expected_batch_size": B,
        "physical_batch_size": PHYS,
        **({"vocab": VOCAB} if toy else {"max_length": MINILM_MAX_LENGTH}),
        "load_average_1min": loads,
        "cpus": os.cpu_count(),
        "sizes": sizes,
        "dp_bitfit_1proc_2threads": one,
        "dp_2proc_over_1proc_speedup": sizes[first]["dp_bitfit"]["examples_per_s_median"]
        / one["examples_per_s_median"],
        "allreduce_bytes_per_logical_step": {"bias": bias, "full": full},
        "bias_over_full_bytes": bias / full,
        "note": "both 2-process arms of a size run in the same gloo job, in alternating "
        "blocks; non-private DDP reduces the same float32 bias gradients once per logical step "
        "(accumulating physical batches under no_sync); the machine's 2 CPUs were shared with "
        "other jobs (load averages above), so absolute rates are noisy",
    }
    if minilm is not None:
        result["bundled_minilm_allreduce_bytes"] = minilm
    stem = "distributed" if args.model is None else f"distributed_{args.model}"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")

    def row(name: str, r: dict) -> str:
        return (
            f"| {name} | {r['processes']} x {r['threads_per_process']} | {r['steps_measured']} | "
            f"{r['examples_per_s_median']:.1f} ({r['examples_per_s_min']:.1f}-"
            f"{r['examples_per_s_max']:.1f}) | {r['step_s_median']:.3f} | "
            f"{1000 * r['cpu_s_per_example_median']:.2f} |"
        )

    rows = [row(f"DP-BiTFiT, {first}", one)]
    lines = []
    for size, r in sizes.items():
        rows += [row(f"DP-BiTFiT, {size}", r["dp_bitfit"]),
                 row(f"non-private DDP bias-only, {size}", r["nonprivate_ddp_bias"])]  # fmt: skip
        o = r["overhead_wall_per_round"]
        lines.append(
            f"* **{size}** ({r['model']}; {r['rounds']} blocks of {r['steps_per_block']} steps "
            f"per arm): overhead {100 * r['overhead_wall_medians']:.1f}% from the wall-clock "
            f"medians; per round median {100 * o['median']:.1f}%, min {100 * o['min']:.1f}%, "
            f"max {100 * o['max']:.1f}%; from CPU time per example {100 * r['overhead_cpu']:.1f}%."
        )
    table = "\n".join(rows)
    overheads = "\n".join(lines)
    after = ", ".join(f"{x:.1f}" for x in loads[1:])
    data = f"vocabulary {VOCAB}" if toy else f"{MINILM_MAX_LENGTH} tokens per example"
    title = "" if toy else ": the bundled MiniLM classifier"
    if toy:
        bytes_note = "(target <= 0.2%; this small model has relatively more biases than a real "
        bytes_note += "transformer)"
    else:
        bytes_note = "(target <= 0.2%; biases + the classification head)"
    md = f"""# Distributed DP-BiTFiT on this machine (gloo){title}

Output of `{command}`.
Logical batch {B} (Poisson for DP), physical batch {PHYS}, {data}. For each model, the two
2-process arms ran in one gloo job, alternating blocks of logical steps (order flipped every
round); then DP-BiTFiT alone in 1 process x 2 threads. 1-minute load average before the first
job: {loads[0]:.1f}; after each job: {after}. The {os.cpu_count()} CPUs were shared with other
jobs: wall-clock rates are noisy; CPU seconds per example (thread time of rank 0 over the
examples of all ranks in the step) are not inflated by waiting for a core.

| run | processes x threads | steps | examples/s median (min-max) | step s (median) | CPU ms per example |
|---|---|---|---|---|---|
{table}

DP-BiTFiT (2 processes) vs non-private DDP bias-only (2 processes), target <= 5%:

{overheads}

* 2 processes x 1 thread over 1 process x 2 threads ({first}): {result["dp_2proc_over_1proc_speedup"]:.2f}x
  (on a busy machine 2 threads of one process wait on each other; this ratio mostly measures
  that contention, not what a quiet machine would show).
* Bytes all-reduced per logical step (float32 trainable parameters, {first}): bias mode
  {bias:,}, full mode {full:,}: {100 * result["bias_over_full_bytes"]:.3f}% {bytes_note}.
"""
    if minilm is not None:
        md += (
            f"* Bundled MiniLM classifier: biases + head {minilm['bias']:,} bytes, full mode "
            f"{minilm['full']:,} bytes per logical step: {100 * minilm['bias_over_full']:.3f}%.\n"
        )
    (RESULTS / f"{stem}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

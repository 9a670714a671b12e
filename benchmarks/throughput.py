"""A roofline for the main job: how close one training step of `dpfit train` comes to what the
machine's matrix units can do, in float32 and in bfloat16 autocast (dpfit.precision).

    PYTHONPATH=src python benchmarks/throughput.py [--threads 2] [--warmup 2 --timed 5]
        [--lengths recipe,128] [--arms nonprivate-bias,dp-bitfit,dp-full]

Peak: the median rate of square matrix products (torch.mm, 1024-4096) on `--threads` threads,
the best size taken, float32 and bfloat16, per wall second and per process CPU second. On a
shared machine use `--threads 1` and read the CPU-second figures: with 2 threads and other jobs
on the 2 cores, OpenMP threads wait on each other and both clocks measure the waiting (a
2-thread run here at load average 9 had bf16 slower than fp32 and steps 10x their 1-thread
CPU time). Main job: the bundled all-MiniLM-L6-v2 classifier as
`dpfit train` builds it (biases + the new head, train mode) on one physical batch of the recipe
(dpfit.recipe: 56 examples) of the bundled Rotten Tomatoes texts, at

* `recipe`: the padded length of the median physical batch that the recipe's run pads to (a
  logical batch of 1,012 random reviews, sorted by length, cut into physical batches of 56);
* `128`: the recipe's maximum length (every text padded to it).

Arms: non-private bias-only training (AdamW on the biases + head), DP-BiTFiT (PrivacyEngine,
mode "bias", sigma 1, the gradient check on, as `dpfit train` runs it), DP full (mode "full",
ghost norms), each with the frozen weights cast to bf16 once (dpfit.frozen_casts) and the
attention kernel `dpfit train` chooses (dpfit.attention: eager in bf16, SDPA in float32), as
`dpfit train` runs them; DP-BiTFiT with SDPA in both precisions (`dp-bitfit-sdpa`), to
measure what that choice gains; and, with `--arms ...,dp-bitfit-recast`, DP-BiTFiT with
autocast recasting the frozen weights on every call (the earlier behaviour; the Intel AMX
result `throughput_intel_amx.md` has it); `dp-bitfit-nocheck`: DP-BiTFiT with
`check_gradients=False`, what the per-step gradient check costs. Each step is timed side by side: every timed round runs every (arm, precision)
once, in a rotating order, so the shared machine's load falls on all of them alike; 2 warm-up
rounds, then medians of the timed ones. Achieved rate = model FLOPs per example (from the
shapes, `model_flops`) x examples per (wall or CPU) second.

FLOPs convention (per token; d model width, f FFN width, L padded length, n layers): forward
n * (2 * (4 d^2 + 2 d f) + 4 L d) (the products of Q, K, V, output, FFN, and of the attention
scores and values). The backward pass computes input gradients (as much again, and twice the
attention score products) and, where weights train (DP full), weight gradients (the linear
products once more). Bias-only training computes no weight gradients for frozen weights. The
pooler and head add 2 d^2 + 2 d c per example. Norms, clipping, noise, layer norms, softmax and
elementwise work are not counted: they are part of what a step costs, not of the model's FLOPs.

Memory: the bytes autograd saves for the backward pass (torch.autograd.graph.
saved_tensors_hooks, each storage counted once), per arm and precision.

After the timed rounds, torch.profiler splits three DP-BiTFiT steps per precision by kind of
op (matrix products, dropout's random draws, copies and casts, the rest), and the table ends
with the per-step targets (bf16 / fp32 speed, share of the bf16 peak, DP-BiTFiT / non-private
bias-only time and memory), met or not.

Writes benchmarks/results/throughput.{json,md,png}.

    PYTHONPATH=src python benchmarks/throughput.py --train-compare 3000 [--threads 2]

runs instead the default `dpfit train` twice, fp32 then bf16, on a random subset of that many
training examples (--max-train-examples), with --insecure-reproducible-noise so that both runs
draw the same Poisson batches and the same noise (the accuracy difference is then the
precision's alone; those two models are not private against anyone who knows the seed), and
writes benchmarks/results/throughput_train.{json,md}: wall and CPU time of each whole run
(load, features, training, evaluation), the CPU time of the main phase's logical steps 2..T
(the process CPU time after each step, from `dpfit train`'s on_step callback: the same
batches in both runs, so its ratio is the ratio of examples per CPU second), and accuracy. One seed on one task: a check that
bf16 does not break training, not the utility suite's 3 tasks x 3 seeds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
ARMS = {
    "nonprivate-bias": "non-private bias-only",
    "dp-bitfit": "DP-BiTFiT",
    "dp-full": "DP full",
    "dp-bitfit-recast": "DP-BiTFiT, frozen weights recast per call",
    "dp-bitfit-sdpa": "DP-BiTFiT, SDPA attention in both precisions",
    "dp-bitfit-nocheck": "DP-BiTFiT without the per-step gradient check",
}
DEFAULT_ARMS = "nonprivate-bias,dp-bitfit,dp-full,dp-bitfit-sdpa"
# the targets, checked in the rendered table
TARGET_SPEEDUP = 1.8  # bf16 / fp32 examples/s
TARGET_PEAK_FRACTION = 0.60  # of the bf16 matrix-product peak
TARGET_DP_OVER_NONPRIVATE = 1.02  # time and memory, bf16
PRECISIONS = ("fp32", "bf16")
PEAK_SIZES = (1024, 2048, 4096)


def matmul_peak(dtype, sizes=PEAK_SIZES, warmup: int = 2, timed: int = 5) -> dict:
    """GFLOP/s of square products, median of `timed` per size, per wall second and per
    process CPU second (with one thread, what the core did while it ran: other jobs on a
    shared machine do not dilute it); the best size is the peak."""
    import torch

    rates, cpu_rates = {}, {}
    for n in sizes:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        times, cpus = [], []
        for i in range(warmup + timed):
            t0, c0 = time.perf_counter(), time.process_time()
            torch.mm(a, b)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
        rates[n] = 2 * n**3 / statistics.median(times) / 1e9
        cpu_rates[n] = 2 * n**3 / statistics.median(cpus) / 1e9
    best = max(rates, key=rates.get)
    best_cpu = max(cpu_rates, key=cpu_rates.get)
    return {
        "gflops": rates[best],
        "size": best,
        "by_size": rates,
        "gflops_cpu": cpu_rates[best_cpu],
        "size_cpu": best_cpu,
        "by_size_cpu": cpu_rates,
    }


def model_flops(cfg, length: int, num_labels: int, weights_train: bool) -> dict:
    """Model FLOPs per example of one training step (see the module docstring)."""
    d, f, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    linear = 2 * (4 * d * d + 2 * d * f)  # per token per layer
    attn = 4 * length * d  # QK^T and PV, per token per layer
    fwd = n * length * (linear + attn) + 2 * d * d + 2 * d * num_labels
    bwd_input = n * length * (linear + 2 * attn) + 2 * d * d + 2 * d * num_labels
    bwd_weight = (n * length * linear + 2 * d * d) if weights_train else 0
    head_weight = 2 * d * num_labels  # the new head's weight trains in every arm
    total = fwd + bwd_input + bwd_weight + head_weight
    return {"forward": fwd, "total": total}


@dataclass
class Arm:
    name: str
    step: Callable[[str], None]  # one training step on the fixed batch, in a precision
    model: object


def padded_batch(tokenizer, train, physical: int, length: int, collate) -> dict:
    """The first `physical` training texts, every one padded (or cut) to `length` tokens."""
    enc = tokenizer(
        list(train.texts[:physical]), truncation=True, padding="max_length", max_length=length
    )
    keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
    items = [
        {**{k: enc[k][i] for k in keys}, "labels": int(train.labels[i])} for i in range(physical)
    ]
    return collate(items)


def recipe_lengths(tokenizer, texts, physical: int, logical: int, max_length: int, seed=0):
    """Padded lengths of the physical batches of one recipe-sized logical batch."""
    import random

    lens = [
        min(max_length, len(ids))
        for ids in tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    ]
    rng = random.Random(seed)
    chosen = sorted(rng.sample(lens, min(logical, len(lens))))
    return [max(chosen[i : i + physical]) for i in range(0, len(chosen), physical)]


def recipe_shapes(loaded, texts) -> tuple[int, list[int]]:
    """The recipe's physical batch for the bundled MiniLM on `texts` (the bundled Rotten
    Tomatoes training split), and the padded lengths of one recipe-sized logical batch."""
    from dpfit.recipe import MAX_LENGTH, physical_batch_for, resolve_recipe

    total_params = sum(p.numel() for p in loaded.model.parameters())
    recipe = resolve_recipe(len(texts), 2, 8.0, 1e-5, total_params)
    physical = physical_batch_for(total_params, MAX_LENGTH)
    pads = recipe_lengths(loaded.tokenizer, texts, physical, recipe.batch_size, MAX_LENGTH)
    return physical, pads


def build_arms(
    batch: dict, names: list[str], lr: float = 1e-3, dropout: float | str | None = None
) -> list[Arm]:
    """dropout: the backbone's rate (dpfit.dropout; None: the model's own), the same in every
    arm so that the arms differ only in what they compute."""
    import torch

    import dpfit
    from dpfit import precision
    from dpfit.attention import eager_is_faster
    from dpfit.frozen_casts import FrozenWeightCasts
    from dpfit.models import load_classifier

    arms = []
    n = int(batch["labels"].shape[0])
    for name in names:
        loaded = load_classifier(None, ["rotten", "fresh"], seed=0, dropout=dropout)
        model = loaded.model
        if name == "dp-full":
            for p in model.parameters():
                p.requires_grad_(True)
        else:
            dpfit.make_bias_trainable(model, train_head=loaded.head_names)
        model.train()
        engine = None
        if name == "nonprivate-bias":
            params = [p for p in model.parameters() if p.requires_grad]
        else:
            engine = dpfit.PrivacyEngine(
                model,
                expected_batch_size=n,
                sample_size=10 * n,
                noise_multiplier=1.0,
                max_grad_norm=1.0,
                clipping="automatic",
                mode="full" if name == "dp-full" else "bias",
                sampling="user-poisson",
                check_gradients=name != "dp-bitfit-nocheck",
            )
            params = engine.parameters()
        opt = torch.optim.AdamW(params, lr=lr)
        inputs = dict(batch)
        if name == "dp-full":  # full mode: every input with its batch axis
            width = inputs["input_ids"].shape[1]
            inputs["position_ids"] = torch.arange(width).expand(n, width).clone()

        # as `dpfit train` runs a step: frozen weights cast to bf16 once (dpfit.frozen_casts);
        # the -recast arm leaves that to autocast, which casts them again on every call
        recast = name == "dp-bitfit-recast"
        casts = {p: FrozenWeightCasts(model, p, "cpu") for p in PRECISIONS}
        # the attention kernel `dpfit train` runs in each precision (dpfit.attention); the
        # -sdpa arm keeps SDPA in both, to measure what the choice gains
        width = int(inputs["input_ids"].shape[1])
        cpu = torch.device("cpu")
        kernels = {
            p: "eager" if name != "dp-bitfit-sdpa" and eager_is_faster(cpu, width, p) else "sdpa"
            for p in PRECISIONS
        }

        def step(
            prec: str, model=model, opt=opt, engine=engine, inputs=inputs, casts=casts,
            recast=recast, kernels=kernels,
        ) -> None:  # fmt: skip
            if model.backbone.config._attn_implementation != kernels[prec]:
                model.backbone.set_attn_implementation(kernels[prec])
            with contextlib.nullcontext() if recast else casts[prec].active():
                with precision.autocast(prec, "cpu"):
                    loss = model(**inputs).loss
                loss.backward()
            if engine is None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                engine.step(opt, batch_size=n)

        arms.append(Arm(name, step, model))
    return arms


def saved_bytes(arm: Arm, prec: str) -> int:
    """Bytes autograd saves for one step's backward (each storage once)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t):
        try:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except RuntimeError:
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        arm.step(prec)
    return sum(seen.values())


# torch.profiler op names, by what they are (self CPU time; the rest is "other")
OP_KINDS = {
    "matrix products": ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm"),
    "dropout masks (random draws)": ("aten::bernoulli_",),
    "copies and dtype casts": ("aten::copy_",),
}


def _op_times(arm: Arm, prec: str, steps: int) -> dict[str, tuple[float, float]]:
    """torch.profiler over `steps` steps: {op name: (self CPU ms per step, calls per step)}."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            arm.step(prec)
    return {
        e.key: (e.self_cpu_time_total / steps / 1e3, e.count / steps) for e in prof.key_averages()
    }


def profile_kinds(arm: Arm, prec: str, steps: int = 3) -> dict:
    """Where one step's CPU time goes (torch.profiler self CPU time by kind of op, over `steps`
    steps). The profiler's own cost inflates small ops, so read the shares, not the
    milliseconds."""
    by_name = {k: ms for k, (ms, _) in _op_times(arm, prec, steps).items()}
    total = sum(by_name.values())
    kinds = {k: sum(by_name.get(n, 0.0) for n in names) for k, names in OP_KINDS.items()}
    kinds["other (elementwise, norms, softmax, reductions, optimizer, ...)"] = total - sum(
        kinds.values()
    )
    return {k: v / total for k, v in kinds.items()}


def profile_overhead(base: Arm, arm: Arm, prec: str, steps: int = 5, top: int = 4) -> dict:
    """What `arm` spends beyond `base`, op by op: torch.profiler self CPU ms per step of each,
    the `top` ops with the largest difference (and the calls per step, which tell an op the
    engine adds from one both run)."""
    b, d = _op_times(base, prec, steps), _op_times(arm, prec, steps)
    none = (0.0, 0.0)
    rows = [
        {"op": k, "base_ms": b.get(k, none)[0], "base_calls": b.get(k, none)[1],
         "arm_ms": d.get(k, none)[0], "arm_calls": d.get(k, none)[1]}
        for k in set(b) | set(d)
    ]  # fmt: skip
    rows.sort(key=lambda r: r["arm_ms"] - r["base_ms"], reverse=True)
    return {
        "base_total_ms": sum(v[0] for v in b.values()),
        "arm_total_ms": sum(v[0] for v in d.values()),
        "top": rows[:top],
    }


def measure(arms: list[Arm], n: int, warmup: int, timed: int) -> dict:
    """Seconds per step (wall and process CPU), interleaved round by round."""
    combos = [(a, p) for a in arms for p in PRECISIONS]
    wall: dict[tuple[str, str], list[float]] = {(a.name, p): [] for a, p in combos}
    cpu: dict[tuple[str, str], list[float]] = {(a.name, p): [] for a, p in combos}
    for r in range(warmup + timed):
        k = r % len(combos)
        for arm, prec in combos[k:] + combos[:k]:  # rotating order
            t0, c0 = time.perf_counter(), time.process_time()
            arm.step(prec)
            t1, c1 = time.perf_counter(), time.process_time()
            if r >= warmup:
                wall[(arm.name, prec)].append(t1 - t0)
                cpu[(arm.name, prec)].append(c1 - c0)
        print(f"  round {r + 1}/{warmup + timed} done", file=sys.stderr, flush=True)
    return {
        key: {
            "wall_s": statistics.median(wall[key]),
            "cpu_s": statistics.median(cpu[key]),
            "wall_all": wall[key],
        }
        for key in wall
    }


def run(args) -> dict:
    import torch

    from dpfit.data.text import bundled_rotten_tomatoes
    from dpfit.models import load_classifier
    from dpfit.precision import cpu_bf16_flags
    from dpfit.recipe import default_dropout
    from dpfit.tasks.classification import make_collate

    # every arm with the rate a private `dpfit train` builds the model with (dpfit.recipe)
    dropout = default_dropout(True) if args.dropout is None else args.dropout
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    peaks = {
        p: matmul_peak(torch.float32 if p == "fp32" else torch.bfloat16, args.peak_sizes)
        for p in PRECISIONS
    }
    print(f"peaks GFLOP/s: { {p: round(v['gflops']) for p, v in peaks.items()} }", file=sys.stderr)
    loaded = load_classifier(None, ["rotten", "fresh"], seed=0)
    tokenizer, cfg = loaded.tokenizer, loaded.model.backbone.config
    train = bundled_rotten_tomatoes(seed=0).train
    physical, pads = recipe_shapes(loaded, train.texts)
    lengths = []
    for spec in args.lengths.split(","):
        lengths.append(int(statistics.median_low(pads)) if spec == "recipe" else int(spec))
    collate = make_collate(tokenizer.pad_token_id)
    rows = []
    # keyed by str(length), as the JSON holds them: a fresh run renders as its JSON does
    profiles: dict[str, dict] = {}
    overheads: dict[str, dict] = {}
    for length in lengths:
        batch = padded_batch(tokenizer, train, physical, length, collate)
        arms = build_arms(batch, args.arms.split(","), dropout=dropout)
        for arm in arms:  # the engine's first step also runs its one-example batch-axis probe
            arm.step("fp32")
        mem = {(a.name, p): saved_bytes(a, p) for a in arms for p in PRECISIONS}
        print(f"length {length}: timing {len(arms)} arms x 2 precisions", file=sys.stderr)
        times = measure(arms, physical, args.warmup, args.timed)
        for arm in arms:
            if arm.name == "dp-bitfit":
                profiles[str(length)] = {p: profile_kinds(arm, p) for p in PRECISIONS}
        by_name = {a.name: a for a in arms}
        if "dp-bitfit" in by_name and "nonprivate-bias" in by_name:
            overheads[str(length)] = {
                p: profile_overhead(by_name["nonprivate-bias"], by_name["dp-bitfit"], p)
                for p in PRECISIONS
            }
        for arm in arms:
            flops = model_flops(cfg, length, 2, weights_train=arm.name == "dp-full")
            for prec in PRECISIONS:
                t = times[(arm.name, prec)]
                ex_s = physical / t["wall_s"]
                rows.append(
                    {
                        "length": length,
                        "arm": arm.name,
                        "precision": prec,
                        "wall_s_per_step": t["wall_s"],
                        "cpu_s_per_step": t["cpu_s"],
                        "wall_s_all": t["wall_all"],
                        "examples_per_s": ex_s,
                        "gflop_per_example": flops["total"] / 1e9,
                        "achieved_gflops": flops["total"] * ex_s / 1e9,
                        "fraction_of_peak": flops["total"] * ex_s / 1e9 / peaks[prec]["gflops"],
                        "achieved_gflops_cpu": flops["total"] * physical / t["cpu_s"] / 1e9,
                        "fraction_of_peak_cpu": flops["total"]
                        * physical
                        / t["cpu_s"]
                        / 1e9
                        / peaks[prec]["gflops_cpu"],
                        "saved_mb": mem[(arm.name, prec)] / 2**20,
                    }
                )
        del arms
    return {
        "threads": args.threads,
        "torch": torch.__version__,
        "cpu_bf16_flags": list(cpu_bf16_flags()),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "load_average_at_start": list(os.getloadavg()),
        "warmup": args.warmup,
        "timed": args.timed,
        "physical_batch": physical,
        "dropout": dropout,
        "recipe_padded_lengths": pads,
        "lengths": lengths,
        "peaks": peaks,
        "rows": rows,
        "profiles": profiles,
        "overheads": overheads,
        "command": "python benchmarks/throughput.py " + " ".join(sys.argv[1:]),
    }


def _row(res: dict, length: int, arm: str, prec: str) -> dict | None:
    for r in res["rows"]:
        if (r["length"], r["arm"], r["precision"]) == (length, arm, prec):
            return r
    return None


def _dropout_clause(res: dict) -> str:
    """Results recorded before `dpfit train` turned dropout off ran the model's own rates."""
    rate = res.get("dropout", "model")
    if rate == "model":
        return " Every arm with the model's own dropout rates (0.1)."
    return (
        " Every arm with dropout off, as a private `dpfit train` builds the model."
        if (rate == 0)
        else f" Every arm with dropout {rate:g}."
    )


def render(res: dict) -> str:
    pk = res["peaks"]
    lines = [
        "# Throughput: the main job against the machine's matrix-product peak",
        "",
        f"Generated by `{res['command'].strip()}` (`benchmarks/throughput.py`). torch "
        f"{res['torch']}, {res['threads']} threads, CPU bf16 flags: "
        f"{', '.join(res['cpu_bf16_flags']) or 'none'}; load average at start "
        f"{res['load_average_at_start'][0]:.1f} (a shared machine: read the ratios, measured "
        f"side by side, more than the absolute figures). {res['warmup']} warm-up + "
        f"{res['timed']} timed rounds, every (arm, precision) once per round; medians."
        + _dropout_clause(res),
        "",
        "| matrix-product peak | GFLOP/s per wall s | at size | GFLOP/s per CPU s | at size |",
        "|---|---:|---:|---:|---:|",
    ]
    for p in PRECISIONS:
        lines.append(
            f"| {p} | {pk[p]['gflops']:,.0f} | {pk[p]['size']} | {pk[p]['gflops_cpu']:,.0f} "
            f"| {pk[p]['size_cpu']} |"
        )
    lines += [
        "",
        f"Main job: bundled all-MiniLM-L6-v2, physical batch {res['physical_batch']} (the "
        f"recipe's). The recipe's run pads its physical batches to lengths "
        f"{min(res['recipe_padded_lengths'])}-{max(res['recipe_padded_lengths'])} "
        "(median used as `recipe`).",
        "",
        "| len | arm | precision | s/step (wall) | CPU s/step | examples/s (wall) "
        "| GFLOP/example | achieved GFLOP/s, wall (of peak) | achieved GFLOP/s, CPU (of peak) "
        "| saved for backward MB |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['length']} | {ARMS[r['arm']]} | {r['precision']} | {r['wall_s_per_step']:.3f} "
            f"| {r['cpu_s_per_step']:.3f} | {r['examples_per_s']:.1f} "
            f"| {r['gflop_per_example']:.2f} "
            f"| {r['achieved_gflops']:.1f} ({100 * r['fraction_of_peak']:.1f}%) "
            f"| {r['achieved_gflops_cpu']:.1f} ({100 * r['fraction_of_peak_cpu']:.1f}%) "
            f"| {r['saved_mb']:.0f} |"
        )
    lines += [
        "",
        "Ratios (same run):",
        "",
        "| len | arm | bf16 / fp32 examples/s (wall) | bf16 / fp32 (CPU time) "
        "| bf16 saved / fp32 saved |",
        "|---:|---|---:|---:|---:|",
    ]
    arms = list(dict.fromkeys(r["arm"] for r in res["rows"]))
    for length in res["lengths"]:
        for arm in arms:
            a, b = _row(res, length, arm, "fp32"), _row(res, length, arm, "bf16")
            if a and b:
                lines.append(
                    f"| {length} | {ARMS[arm]} "
                    f"| {b['examples_per_s'] / a['examples_per_s']:.2f}x "
                    f"| {a['cpu_s_per_step'] / b['cpu_s_per_step']:.2f}x "
                    f"| {b['saved_mb'] / a['saved_mb']:.2f} |"
                )
    if "nonprivate-bias" in arms and "dp-bitfit" in arms:
        lines += [
            "",
            "| len | precision | DP-BiTFiT / non-private bias-only: time (wall) | time (CPU) "
            "| saved for backward |",
            "|---:|---|---:|---:|---:|",
        ]
        for length in res["lengths"]:
            for p in PRECISIONS:
                a = _row(res, length, "nonprivate-bias", p)
                b = _row(res, length, "dp-bitfit", p)
                lines.append(
                    f"| {length} | {p} | {b['wall_s_per_step'] / a['wall_s_per_step']:.3f} "
                    f"| {b['cpu_s_per_step'] / a['cpu_s_per_step']:.3f} "
                    f"| {b['saved_mb'] / a['saved_mb']:.3f} |"
                )
    variants = (
        ("dp-bitfit-recast", "Frozen weights cast to bf16 once per run (`dpfit.frozen_casts`, as "
         "`dpfit train` does) against autocast's cast on every call (same rounding, same "
         "results):", "cast once", "recast per call", "recast / once"),
        ("dp-bitfit-sdpa", "The attention kernel `dpfit train` runs (dpfit.attention: eager "
         "attention on CPU under bf16 autocast, SDPA in float32) against SDPA in both "
         "precisions:", "`dpfit train`'s kernel", "SDPA", "SDPA / chosen"),
    )  # fmt: skip
    for variant, intro, ours, theirs, ratio in variants:
        if "dp-bitfit" in arms and variant in arms:
            lines += _variant_table(res, variant, intro, ours, theirs, ratio)
    for length, prof in (res.get("profiles") or {}).items():
        kinds = list(prof["fp32"])
        lines += [
            "",
            f"Where a DP-BiTFiT step's CPU time goes (len {length}; torch.profiler, self CPU "
            "time by kind of op over 3 steps, after the timed rounds; the profiler inflates "
            "small ops, so these are rough shares):",
            "",
            "| kind of op | fp32 | bf16 |",
            "|---|---:|---:|",
        ]
        for k in kinds:
            lines.append(f"| {k} | {100 * prof['fp32'][k]:.0f}% | {100 * prof['bf16'][k]:.0f}% |")
    lines += render_overheads(res.get("overheads") or {})
    lines += render_targets(res, arms)
    return "\n".join(lines) + "\n"


def _variant_table(res: dict, variant: str, intro: str, ours: str, theirs: str, ratio: str):
    """DP-BiTFiT as `dpfit train` runs it against one variant arm, CPU s per step."""
    lines = ["", intro, "", f"| len | precision | DP-BiTFiT CPU s/step, {ours} | {theirs} | "
             f"{ratio} |", "|---:|---|---:|---:|---:|"]  # fmt: skip
    for length in res["lengths"]:
        for p in PRECISIONS:
            a, b = _row(res, length, "dp-bitfit", p), _row(res, length, variant, p)
            lines.append(
                f"| {length} | {p} | {a['cpu_s_per_step']:.3f} | {b['cpu_s_per_step']:.3f} "
                f"| {b['cpu_s_per_step'] / a['cpu_s_per_step']:.3f} |"
            )
    return lines


def render_overheads(overheads: dict) -> list[str]:
    """DP-BiTFiT minus non-private bias-only, op by op (profile_overhead's records)."""
    lines: list[str] = []
    for length, by_prec in overheads.items():
        lines += [
            "",
            f"What DP-BiTFiT adds to a step, op by op (len {length}; torch.profiler self CPU ms "
            "per step over 5 steps of each arm, after the timed rounds; the ops with the "
            "largest difference, with their calls per step). The profiler's own cost inflates "
            "the totals beyond the timed difference above, and an op both arms call equally "
            "often differs only by noise: what DP-BiTFiT adds are the ops whose calls differ.",
            "",
            "| precision | op | non-private bias-only ms (calls) | DP-BiTFiT ms (calls) | "
            "difference ms |",
            "|---|---|---:|---:|---:|",
        ]
        for p, o in by_prec.items():
            lines.append(
                f"| {p} | all ops | {o['base_total_ms']:.1f} | {o['arm_total_ms']:.1f} | "
                f"{o['arm_total_ms'] - o['base_total_ms']:+.1f} |"
            )
            for r in o["top"]:
                lines.append(
                    f"| {p} | `{r['op']}` | {r['base_ms']:.2f} ({r['base_calls']:.0f}) | "
                    f"{r['arm_ms']:.2f} ({r['arm_calls']:.0f}) | "
                    f"{r['arm_ms'] - r['base_ms']:+.2f} |"
                )
    return lines


def render_targets(res: dict, arms: list[str]) -> list[str]:
    """The issue's per-step targets, met or not, with the measured number (CPU time)."""
    if "dp-bitfit" not in arms:
        return []
    pk = res["peaks"]["bf16"]["gflops_cpu"]
    lines = ["", "Targets (per step, CPU time, this run):", "", "| len | target | measured | met |"]
    lines.append("|---:|---|---:|---|")
    ceiling: list[tuple[int, float, float]] = []  # (len, achieved fraction, matmul share)

    def add(length, what, value, ok, fmt):
        lines.append(f"| {length} | {what} | {fmt.format(value)} | {'yes' if ok else 'no'} |")

    for length in res["lengths"]:
        a, b = _row(res, length, "dp-bitfit", "fp32"), _row(res, length, "dp-bitfit", "bf16")
        speed = a["cpu_s_per_step"] / b["cpu_s_per_step"]
        add(length, f"DP-BiTFiT bf16 / fp32 examples/s >= {TARGET_SPEEDUP}", speed,
            speed >= TARGET_SPEEDUP, "{:.2f}x")  # fmt: skip
        frac = b["achieved_gflops_cpu"] / pk
        add(length, f"DP-BiTFiT bf16 achieved >= {TARGET_PEAK_FRACTION:.0%} of bf16 peak", frac,
            frac >= TARGET_PEAK_FRACTION, "{:.1%}")  # fmt: skip
        share = ((res.get("profiles") or {}).get(str(length)) or {}).get("bf16", {})
        if share.get("matrix products"):
            ceiling.append((length, frac, share["matrix products"]))
        c = _row(res, length, "nonprivate-bias", "bf16")
        if c:
            t = b["cpu_s_per_step"] / c["cpu_s_per_step"]
            m = b["saved_mb"] / c["saved_mb"]
            add(length, f"bf16 DP-BiTFiT / non-private bias-only time <= "
                f"{TARGET_DP_OVER_NONPRIVATE}", t, t <= TARGET_DP_OVER_NONPRIVATE, "{:.3f}")  # fmt: skip
            add(length, f"bf16 DP-BiTFiT / non-private bias-only saved memory <= "
                f"{TARGET_DP_OVER_NONPRIVATE}", m, m <= TARGET_DP_OVER_NONPRIVATE, "{:.3f}")  # fmt: skip
    for length, frac, share in ceiling:
        lines += [
            "",
            f"What the share of the peak can reach at len {length}: the bf16 step's matrix "
            f"products are {share:.0%} of its CPU time (the profile above), so at their own "
            f"rate they run at {frac:.1%} / {share:.2f} = {frac / share:.0%} of the peak; a "
            "step whose every other op took no time at all would reach that, and no more. "
            "The profiler inflates small ops, so the true share, and this ceiling, are rough.",
        ]
    return lines


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"{ARMS[r['arm']]}\nlen {r['length']}" for r in rows if r["precision"] == "fp32"]
    xs = range(len(labels))
    for off, prec, color in ((-0.2, "fp32", "tab:blue"), (0.2, "bf16", "tab:orange")):
        vals = [r["achieved_gflops_cpu"] for r in rows if r["precision"] == prec]
        ax.bar([x + off for x in xs], vals, width=0.4, label=f"achieved, {prec}", color=color)
        ax.axhline(
            res["peaks"][prec]["gflops_cpu"], color=color, ls="--", lw=1, label=f"mm peak, {prec}"
        )
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("GFLOP/s per CPU second (model FLOPs)")
    ax.set_title(f"MiniLM training step vs matrix-product peak ({res['threads']} threads)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def train_worker(marks_path: str, dpfit_argv: list[str]) -> int:
    """`dpfit train` as the CLI builds it, with the process CPU time after every main-phase
    logical step written to `marks_path` (the CPU time of the training loop alone)."""
    from dpfit.cli import _set_threads, build_parser, train_config_from_args
    from dpfit.train import train

    args = build_parser().parse_args(dpfit_argv)
    _set_threads(args.threads)
    marks: list[float] = []
    train(
        train_config_from_args(args), on_step=lambda row, total: marks.append(time.process_time())
    )
    Path(marks_path).write_text(json.dumps(marks))
    return 0


def train_compare(max_train: int, threads: int) -> dict:
    """The default `dpfit train`, fp32 then bf16, same data subset, batches and noise."""
    from dpfit.precision import cpu_bf16_flags

    runs = {}
    for prec in PRECISIONS:
        with tempfile.TemporaryDirectory() as tmp:
            marks_path = str(Path(tmp) / "marks.json")
            cmd = [
                sys.executable, str(Path(__file__).resolve()), "--_train-worker", marks_path,
                "train", "--max-train-examples", str(max_train),
                "--precision", prec, "--insecure-reproducible-noise", "--threads", str(threads),
                "--quiet", "--output", str(Path(tmp) / "run"),
            ]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            if proc.returncode != 0:
                raise SystemExit(f"dpfit train --precision {prec} failed: {proc.stderr[-2000:]}")
            m = json.loads((Path(tmp) / "run" / "metrics.json").read_text())
            marks = json.loads(Path(marks_path).read_text())
        runs[prec] = {
            # main phase, logical steps 2..T (the first one's CPU time is not in the marks)
            "loop_cpu_s": marks[-1] - marks[0],
            "loop_steps_timed": len(marks) - 1,
            "wall_s": wall,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "train_time_s": m["train_time_s"],
            "accuracy": m.get("accuracy"),
            "epsilon": m["epsilon"],
            "steps": m["steps"],
            "head_first_steps": m["head_first_steps"],
            "batch_size": m["batch_size"],
            "epochs": m["epochs"],
            "precision_recorded": m["config"].get("precision"),
            "command": " ".join(["dpfit", *cmd[4:-2]]),
        }
        print(f"  {prec}: {runs[prec]}", file=sys.stderr, flush=True)
    return {
        "max_train_examples": max_train,
        "threads": threads,
        "cpu_bf16_flags": list(cpu_bf16_flags()),
        "load_average_at_start": list(os.getloadavg()),
        "runs": runs,
        "command": "python benchmarks/throughput.py " + " ".join(sys.argv[1:]),
    }


def render_train(res: dict) -> str:
    a, b = res["runs"]["fp32"], res["runs"]["bf16"]
    lines = [
        "# `dpfit train`, fp32 against bf16 (one short run each)",
        "",
        f"Generated by `{res['command'].strip()}`. The default `dpfit train` on "
        f"{res['max_train_examples']} random training examples, {res['threads']} threads, run "
        "one after the other on a shared machine (load average at start "
        f"{res['load_average_at_start'][0]:.1f}); same Poisson batches and noise in both "
        "(--insecure-reproducible-noise), so the accuracy difference is the precision's. One "
        "seed on one task: not the utility suite's 3 tasks x 3 seeds.",
        "",
        "| precision | wall s (whole run) | CPU s (whole run) | train loop s (wall) "
        "| main-phase CPU s (steps 2..T) | steps (+ head-first) | epsilon | accuracy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for prec, r in res["runs"].items():
        lines.append(
            f"| {prec} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['train_time_s']:.1f} "
            f"| {r['loop_cpu_s']:.1f} | {r['steps']} (+{r['head_first_steps']}) "
            f"| {r['epsilon']:.3f} | {r['accuracy']:.4f} |"
        )
    loop = a["loop_cpu_s"] / b["loop_cpu_s"]
    whole = a["cpu_s"] / b["cpu_s"]
    lines += [
        "",
        f"bf16 / fp32: speed-up {a['wall_s'] / b['wall_s']:.2f}x wall, "
        f"{whole:.2f}x CPU time, {a['train_time_s'] / b['train_time_s']:.2f}x "
        f"train loop (wall); accuracy {b['accuracy'] - a['accuracy']:+.4f}.",
        "",
        "The main phase runs the same logical steps on the same Poisson batches in both, so its "
        "CPU-time ratio is its ratio of examples per CPU second: "
        f"{loop:.2f}x (target {TARGET_SPEEDUP}x: {'met' if loop >= TARGET_SPEEDUP else 'not met'}"
        f"); whole run, loading, features, evaluation and accounting included: {whole:.2f}x "
        f"({'met' if whole >= TARGET_SPEEDUP else 'not met'}).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--_train-worker"]:  # one run of train_compare
        return train_worker(argv[1], argv[2:])
    from dpfit.dropout import parse_rate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timed", type=int, default=5)
    ap.add_argument("--lengths", default="recipe,128", help="comma list: recipe and/or numbers")
    ap.add_argument("--arms", default=DEFAULT_ARMS)
    ap.add_argument(
        "--dropout",
        type=parse_rate,
        help="every arm's dropout rate, or 'model' (default: private dpfit train's, off)",
    )
    ap.add_argument("--peak-sizes", type=lambda s: tuple(int(x) for x in s.split(",")),
                    default=PEAK_SIZES)  # fmt: skip
    ap.add_argument("--out", default=str(RESULTS / "throughput"))
    ap.add_argument(
        "--train-compare", type=int, metavar="N", help="instead: dpfit train fp32 vs bf16 on N"
    )
    ap.add_argument("--from-json", help="render this recorded result again; measure nothing")
    args = ap.parse_args(argv)
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        Path(args.from_json).with_suffix(".md").write_text(render(res))
        print(render(res))
        return 0
    if args.train_compare:
        res = train_compare(args.train_compare, args.threads)
        out = Path(args.out + "_train")
        out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
        out.with_suffix(".md").write_text(render_train(res))
        print(render_train(res))
        return 0
    res = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(render(res))
    plot(res, out.with_suffix(".png"))
    print(render(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

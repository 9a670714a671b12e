"""Private image classification on FashionMNIST: public pretraining, then private fine-tuning.

Setting: a seeded random 10% of FashionMNIST's training set is declared public; the model
(``resnet-gn`` or ``vit-tiny`` from dpfit's factory) is pretrained on it without privacy
(``dpfit pretrain``), then fine-tuned on the private rest, scored on the official test split.

``utility`` rows (one fresh worker process per row, appended to a JSONL file as they finish,
so an interrupted benchmark resumes where it stopped; rows already present are skipped):

    public-only                     the public checkpoint alone (no private training), scored
                                    on the rows' test images: what private training must beat
    nonpriv-full, nonpriv-bias      non-private full / bias-only fine-tuning
    dp-head                         DP last layer (the head alone)
    dp-bitfit                       DP-BiTFiT = 0+BiTFiT (biases + head)
    dp-full                         DP full fine-tuning
    1+bitfit, 2+bitfit              X epochs of DP full, then DP-BiTFiT, under one budget

Each row records accuracy, epsilon, wall time of the training loop and the worker's peak RSS
(whole process: interpreter, data set, model; see ``scan`` for the step's own memory).

``scan`` rows: time and memory of one training step at 28, 56 and 112 pixels (FashionMNIST
upsampled), for non-private bias-only, dpfit DP-BiTFiT, dpfit DP full and Opacus DP full
(hooks), on one fixed batch. Each (round, size, method) runs two fresh workers, methods
alternating within a size: one takes the median wall and CPU time of the timed steps after
the warm-up ones; the other, with glibc's mmap threshold pinned (``PINNED_MALLOC``, so that
RSS follows the live tensors rather than what the heap kept), takes the peak RSS over a few
steps after the warm-up minus RSS just before them (Linux: VmHWM after a reset through
/proc/self/clear_refs), and torch's own tensor peak of one step (profiler memory events). The
report gives each method's median over the rounds of the newest run (``--rounds``). The first
design (one worker, warm-up step inside the memory window, default allocator) let one-time
set-up and heap retention into the memory figure: its DP-BiTFiT / non-private ratios of
1.09-1.17 came from there, not from the step (see benchmarks/results/vision.md).

    python benchmarks/vision.py utility --models resnet-gn --eps 8 --rows dp-full dp-bitfit 1+bitfit
    python benchmarks/vision.py scan --sizes 28 56 112
    python benchmarks/vision.py report      # writes benchmarks/results/vision.md and vision.json

The scale is set for a 2-core CPU shared with other jobs: by default private fine-tuning uses
a seeded random 1,000 of the 54,000 private images (``--private-examples``; the sampling rate
and epsilon are those of the subset actually used), logical batch 64, 3 epochs, and scores a
seeded random 2,000 of the 10,000 test images. ``DPFIT_BENCH_THREADS`` sets torch threads (1).
Several ``utility`` commands may run at once on one row list: each row runs once (claim
files in ``--work``). The committed rows came from

    python benchmarks/vision.py utility --models resnet-gn --seeds 0 1 2 --eps 8 2
    python benchmarks/vision.py utility --models vit-tiny --seeds 0 1 2 --eps 2 8
    python benchmarks/vision.py scan --sizes 28 56 112 --steps 20 --rounds 3  # size scan rows
    # the larger point: 10,000 private images, logical batch 256 (117 steps), eps 8
    python benchmarks/vision.py utility --models resnet-gn --seeds 0 --eps 8 \
        --private-examples 10000 --batch-size 256 --rows dp-bitfit dp-full 2+bitfit 1+bitfit

each under ``nice -n 10``, several streams at once, all from the ``legacy`` public checkpoint
(``--pretrain legacy``: 3 epochs at a constant lr 2e-3, no augmentation). The default
``--pretrain default`` uses ``dpfit pretrain``'s own defaults (dpfit.vision.pretrain: epochs
from the public n, cosine lr, shift augmentation); rows record which checkpoint they started
from and the report keeps the two apart. From it, one stream, one row at a time:

    python benchmarks/vision.py utility --models resnet-gn --seeds 0 --eps 8 \
        --private-examples 27000 --batch-size 512 --rows dp-full 2+bitfit dp-bitfit
    # all 54,000 private images, scored on all 10,000 test images
    python benchmarks/vision.py utility --models resnet-gn --seeds 0 --eps 8 \
        --private-examples 54000 --eval-examples 10000 --batch-size 512 \
        --rows public-only dp-full 2+bitfit dp-bitfit nonpriv-full nonpriv-bias dp-head 1+bitfit
    python benchmarks/vision.py utility --models resnet-gn --seeds 1 2 --eps 8 \
        --private-examples 54000 --eval-examples 10000 --batch-size 512 \
        --rows public-only dp-full 2+bitfit
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from harness.memory import peak_rss, reset_peak_rss, rss_now
from harness.records import append_jsonl, read_jsonl
from harness.workers import run_json_worker

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
RUNS = RESULTS / "vision_runs.jsonl"
SCAN = RESULTS / "vision_scan.jsonl"
ROWS = (
    "public-only", "nonpriv-full", "nonpriv-bias", "dp-head", "dp-bitfit", "dp-full", "1+bitfit",
    "2+bitfit",
)  # fmt: skip
# rows whose result does not depend on epsilon (run once, under the first --eps)
NO_EPS_ROWS = ("public-only", "nonpriv-full", "nonpriv-bias")
LABELS = {
    "public-only": "public checkpoint alone",
    "nonpriv-full": "non-private full",
    "nonpriv-bias": "non-private bias-only",
    "dp-head": "DP last layer (head)",
    "dp-bitfit": "DP-BiTFiT (0+BiTFiT)",
    "dp-full": "DP full",
    "1+bitfit": "1+BiTFiT",
    "2+bitfit": "2+BiTFiT",
}
SCAN_METHODS = ("nonpriv-bias", "dpfit-bitfit", "dpfit-full", "opacus-full")
# learning rates (AdamW): full-weight updates want a smaller step than biases and the head
LR_FULL, LR_BIAS = 1e-3, 5e-3


def _threads() -> int:
    return int(os.environ.get("DPFIT_BENCH_THREADS", "1"))


# ---------------------------------------------------------------------------- utility rows
def row_config(row: str, model_dir: str, eps: float, seed: int, args) -> dict:
    """One row as JSON-able kwargs: {"train": TrainConfig fields, "image": ImageOptions fields}.

    Every recipe field is set, so the rows do not move when the recipe's defaults do."""
    base = dict(
        task="image-classification",
        model=model_dir,
        epochs=args.epochs,
        batch_size=args.batch_size,
        physical_batch_size=args.physical_batch_size,
        max_train_examples=args.private_examples,
        seed=seed,
        max_grad_norm=args.max_grad_norm,
        clipping=args.clipping,
        lr_schedule=args.lr_schedule,
    )
    lr_full = args.lr_full or LR_FULL
    image = dict(image_size=args.image_size, max_eval_examples=args.eval_examples)
    if row == "public-only":  # scored on the test images the training rows use (same seed)
        evaluate = {"model": model_dir, "seed": seed, "private_examples": args.private_examples}
        return {"evaluate": evaluate, "image": image}
    if row.startswith("nonpriv"):
        mode = "full" if row == "nonpriv-full" else "bias"
        train = {**base, "non_private": True, "epsilon": None, "mode": mode,
                 "lr": lr_full if mode == "full" else LR_BIAS}  # fmt: skip
        return {"train": train, "image": image}
    base["epsilon"] = eps
    if row == "dp-head":
        return {"train": {**base, "lr": LR_BIAS}, "image": {**image, "head_only": True}}
    if row == "dp-bitfit":
        return {"train": {**base, "mode": "bias", "lr": LR_BIAS}, "image": image}
    if row == "dp-full":
        return {"train": {**base, "mode": "full", "lr": lr_full}, "image": image}
    x = int(row.split("+")[0])
    if not 0 < x < args.epochs:
        raise SystemExit(f"{row} needs --epochs > {x}")
    return {"train": {**base, "full_epochs": x, "lr": lr_full, "full_lr": lr_full}, "image": image}


# The public checkpoint a row starts from. "legacy": the first recipe (3 epochs, constant
# lr 2e-3, no augmentation), which rows from before this field was recorded used; "default":
# `dpfit pretrain`'s defaults (dpfit.vision.pretrain: epochs from the public n, cosine lr,
# shift augmentation).
PRETRAINS = {
    "legacy": dict(epochs=3, lr_schedule="constant", augment="none"),
    "default": dict(epochs=None),
}
PRETRAIN_LABELS = {
    "legacy": "3 epochs, constant lr",
    "default": "dpfit pretrain defaults: epochs from public n, cosine lr, shift augmentation",
}


def _pretrain_of(r: dict) -> str:
    return r.get("pretrain") or "legacy"


def pretrain(model: str, args) -> str:
    """Pretrain once per (model, recipe) on the public 10% (cached in the work folder)."""
    suffix = "" if args.pretrain == "legacy" else f"-{args.pretrain}"
    out = Path(args.work) / f"pretrained-{model}-s{args.image_size}{suffix}"
    if (out / "model" / "dpfit-vision.json").is_file():
        return str(out / "model")
    spec = {
        "kind": "pretrain",
        "recipe": PRETRAINS[args.pretrain],  # over dpfit pretrain's defaults, in the worker
        "train": dict(
            task="image-classification", model=model, non_private=True, epsilon=None,
            mode="full", output=str(out),
        ),
        "image": dict(split="public", public_fraction=0.1, image_size=args.image_size,
                      max_eval_examples=args.eval_examples),
    }  # fmt: skip
    res = _spawn(spec)
    _append(
        RESULTS / "vision_pretrain.jsonl",
        {"model": model, "image_size": args.image_size, "pretrain": args.pretrain, **res},
    )
    return str(out / "model")


def cmd_utility(args) -> None:
    done = {_key(r) for r in read_jsonl(RUNS)}
    for model in args.models:
        model_dir = None
        for seed in args.seeds:
            for eps in args.eps:
                for row in args.rows:
                    if row in NO_EPS_ROWS and eps != args.eps[0]:
                        continue  # non-private rows do not depend on epsilon
                    key = dict(model=model, row=row, eps=None if row in NO_EPS_ROWS else eps,
                               seed=seed, image_size=args.image_size, epochs=args.epochs,
                               private_examples=args.private_examples,
                               batch_size=args.batch_size, pretrain=args.pretrain,
                               variant=variant_of(args))  # fmt: skip
                    if _key(key) in done or not _claim(key, args.work):
                        print(f"skip (done or taken by another stream): {key}", flush=True)
                        continue
                    print(f"run: {key}", flush=True)
                    try:
                        model_dir = model_dir or pretrain(model, args)
                        cfg = row_config(row, model_dir, eps, seed, args)
                        kind = "evaluate" if "evaluate" in cfg else "train"
                        res = _spawn({"kind": kind, **cfg})
                    except BaseException:
                        _claim(key, args.work, release=True)
                        raise
                    _append(RUNS, {**key, **res})
                    print(f"  -> acc {res.get('accuracy')}, eps {res.get('epsilon')}, "
                          f"{res.get('train_time_s', 0):.0f} s", flush=True)  # fmt: skip


def _claim(key: dict, work: str, release: bool = False) -> bool:
    """Several `utility` streams may share the row list: each row runs in the one stream
    that creates its claim file first."""
    import hashlib

    folder = Path(work) / "claims"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / hashlib.sha1(repr(_key(key)).encode()).hexdigest()
    if release:
        path.unlink(missing_ok=True)
        return True
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _key(r: dict) -> tuple:
    return tuple(r.get(k) for k in ("model", "row", "eps", "seed", "image_size", "epochs",
                                    "private_examples", "batch_size")) + (
        _pretrain_of(r), r.get("variant") or "")  # fmt: skip


def variant_of(args) -> str:
    """'' for the rows' own optimiser settings, else what departs from them (a row of its own:
    a measured alternative, kept out of the targets)."""
    parts = []
    if args.lr_full not in (None, LR_FULL):
        parts.append(f"full-phase lr {args.lr_full:g}")
    if args.lr_schedule != "constant":
        parts.append(f"{args.lr_schedule} lr")
    if args.clipping != "flat":
        parts.append(f"{args.clipping} clipping")
    return ", ".join(parts)


OLD_DEFAULT_BATCH = 128  # rows from before the batch was recorded ran with this default


def _batch(r: dict) -> int:
    """The logical batch of a row."""
    return int(r["batch_size"]) if r.get("batch_size") is not None else OLD_DEFAULT_BATCH


def _train_worker(spec: dict) -> dict:
    import torch

    from dpfit.tasks.image_classification import ImageOptions
    from dpfit.train import TrainConfig, train

    torch.set_num_threads(_threads())
    t0 = time.perf_counter()
    cpu: dict = {}

    def on_note(msg: str) -> None:  # the recipe note comes just before the loop's setup
        if msg.startswith("recipe") and "start" not in cpu:
            cpu["start"] = time.process_time()
        elif msg.startswith("accuracy of the starting model"):  # scoring it is not training
            cpu["start"] = time.process_time()

    def on_step(row, total: int) -> None:
        cpu["end"] = time.process_time()

    from dpfit.vision.pretrain import PRETRAIN_DEFAULTS, pretrain

    if spec["kind"] == "pretrain":
        recipe = {**PRETRAIN_DEFAULTS, **spec["recipe"]}
        spec["image"]["augment"] = recipe.pop("augment")
        spec["train"].update(recipe)
    config = TrainConfig(**spec["train"], task_options=ImageOptions(**spec["image"]))
    run = pretrain if spec["kind"] == "pretrain" else train  # pretraining's length rule
    m = run(config, on_step=on_step, on_note=on_note).metrics
    keep = ("accuracy", "eval_n", "epsilon", "delta", "noise_multiplier", "sample_rate", "steps",
            "train_examples", "trainable_params", "trainable_fraction", "train_time_s", "mode",
            "trains", "final_train_loss", "batch_size", "epochs", "lr", "lr_schedule")  # fmt: skip
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    # the checkpoint's own score before training, taken by dpfit train itself: it must equal
    # the public-only row's (same images), a check on that row
    start = {"start_accuracy": m["start_accuracy"]} if "start_accuracy" in m else {}
    return {**{k: m[k] for k in keep}, **start, "worker_wall_s": time.perf_counter() - t0,
            "train_cpu_s": cpu.get("end", 0.0) - cpu.get("start", 0.0),
            "worker_cpu_s": ru.ru_utime + ru.ru_stime, "load_avg": os.getloadavg()[0],
            "peak_rss_mb": peak_rss() / 2**20, "threads": _threads()}  # fmt: skip


# ---------------------------------------------------------------------------- size scan
# glibc malloc with its mmap threshold pinned (which also stops it from moving the threshold up
# as large blocks are freed): every tensor above 128 KiB gets its own mapping and goes back to
# the system when freed, so RSS follows the live tensors instead of what the heap kept from
# earlier steps. With the default dynamic threshold, peak RSS growth over the same steps of the
# same arm varied by about 50 MB between processes at 112 px.
MEMORY_STEPS = 3  # steps in the memory window: every step after the warm-up allocates alike
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def cmd_scan(args) -> None:
    """Each (round, size, method) runs two fresh workers: one times the steps under the default
    allocator, one measures memory under PINNED_MALLOC. Methods alternate within a size and
    rounds repeat the whole scan, so the arms see the same machine load; the report takes the
    median over a run's rounds. `--run NAME` resumes a run (rows already in it are skipped)."""
    run = args.run or time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    done = {(r["method"], r["image_size"], r["model"], r.get("round"))
            for r in read_jsonl(SCAN) if r.get("run") == run}  # fmt: skip
    print(f"scan run {run}", flush=True)
    for rnd in range(args.rounds):
        for size in args.sizes:
            for method in args.methods:
                if (method, size, args.model, rnd) in done:
                    continue
                spec = {"kind": "scan", "method": method, "image_size": size,
                        "model": args.model, "batch": args.batch, "steps": args.steps,
                        "warmup": args.warmup}  # fmt: skip
                print(f"scan: round {rnd}, {method} at {size}px", flush=True)
                try:
                    res = _spawn({**spec, "measure": "time"})
                    res.update(_spawn({**spec, "measure": "memory"}, PINNED_MALLOC))
                except SystemExit as e:  # keep the scan going; the report lists the failure
                    res = {"error": str(e)[-500:]}
                _append(SCAN, {"method": method, "image_size": size, "model": args.model,
                               "run": run, "round": rnd, "scan_version": SCAN_VERSION,
                               "warmup": args.warmup, **res})  # fmt: skip


SCAN_VERSION = 2  # 2: warm-up outside the memory window, pinned malloc, tensor peak, rounds


def _scan_step(spec: dict):
    """One training step of the scan's method on a fixed batch (a closure)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    import dpfit
    from dpfit.vision.data import to_pixels
    from dpfit.vision.models import build_model

    size, b, method = spec["image_size"], spec["batch"], spec["method"]
    m = build_model(spec["model"], [str(i) for i in range(10)], 1, size, seed=0)
    model = m.module.train()
    rng = np.random.default_rng(0)
    x = to_pixels(rng.integers(0, 256, (b, 1, 28, 28), dtype=np.uint8), 1, size)
    y = torch.from_numpy(rng.integers(0, 10, b))
    if method in ("nonpriv-bias", "dpfit-bitfit"):
        dpfit.make_bias_trainable(model, train_head=m.head_names)
    if method == "nonpriv-bias":
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

        def step():
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    elif method.startswith("dpfit"):
        engine = dpfit.PrivacyEngine(
            model, expected_batch_size=b, sample_size=10_000, noise_multiplier=1.0,
            sampling="user-poisson", mode="full" if method == "dpfit-full" else "bias",
        )  # fmt: skip
        opt = torch.optim.AdamW(engine.parameters(), lr=1e-3)

        def step():
            F.cross_entropy(model(x), y).backward()
            engine.step(opt, batch_size=x.shape[0])

    else:
        import warnings

        from opacus import PrivacyEngine as OpacusEngine

        warnings.filterwarnings("ignore")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=b)
        gmodel, gopt, _ = OpacusEngine(accountant="rdp").make_private(
            module=model, optimizer=opt, data_loader=dl, noise_multiplier=1.0,
            max_grad_norm=1.0, poisson_sampling=False, grad_sample_mode="hooks",
        )  # fmt: skip

        def step():
            F.cross_entropy(gmodel(x), y).backward()
            gopt.step()
            gopt.zero_grad(set_to_none=True)

    return step


def _scan_worker(spec: dict) -> dict:
    """measure "time": median wall and CPU seconds of the timed steps after the warm-up ones,
    and, for comparison, the first design's memory figure: peak RSS over warm-up and timed
    steps minus RSS before them, default allocator (`first_design_memory_mb`).
    measure "memory" (run under PINNED_MALLOC): peak RSS over MEMORY_STEPS steps minus RSS just
    before them, the warm-up steps (the first step's one-time set-up: optimizer state, lazily
    initialised kernels, which differ between methods) left outside; then torch's own peak of
    tensor bytes allocated during one more step (profiler memory events, allocator-free)."""
    import gc

    import torch

    from dpfit.memory import tensor_peak

    torch.set_num_threads(_threads())
    step = _scan_step(spec)
    out: dict = {"batch": spec["batch"], "steps": spec["steps"], "threads": _threads()}
    gc.collect()
    if not reset_peak_rss():
        raise SystemExit("the scan needs Linux (/proc/self/clear_refs to reset VmHWM)")
    first_base = rss_now()
    for _ in range(spec["warmup"]):
        step()
    gc.collect()
    if spec["measure"] == "time":
        walls, cpus = [], []
        for _ in range(spec["steps"]):
            w0, c0 = time.perf_counter(), time.process_time()
            step()
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
        out.update(wall_s_per_step=statistics.median(walls), cpu_s_per_step=statistics.median(cpus),
                   load_avg=os.getloadavg()[0],
                   first_design_memory_mb=(peak_rss() - first_base) / 2**20)  # fmt: skip
        return out
    reset_peak_rss()
    base = rss_now()
    for _ in range(MEMORY_STEPS):
        step()
    out["step_memory_mb"] = (peak_rss() - base) / 2**20
    out["tensor_peak_mb"] = tensor_peak(step) / 2**20
    out["memory_load_avg"] = os.getloadavg()[0]
    return out


# ---------------------------------------------------------------------------- report
def cmd_report(args) -> None:
    runs, scan_all = list(read_jsonl(RUNS)), list(read_jsonl(SCAN))
    scan = _scan_rows(scan_all)
    pre = list(read_jsonl(RESULTS / "vision_pretrain.jsonl"))
    lines = ["# Private image classification (FashionMNIST): measured rows", ""]
    loads = [r["load_avg"] for r in runs + scan_all if "load_avg" in r]
    load = (
        f" (1-minute load average {min(loads):.0f} to {max(loads):.0f} at the end of the rows that recorded it)"
        if loads
        else ""
    )
    lines.append("Produced by `benchmarks/vision.py`; raw rows in `vision_runs.jsonl`, "
                 "`vision_scan.jsonl`, `vision_pretrain.jsonl`. Wall times are on a 2-core "
                 f"machine shared with other jobs{load}, with several rows running at once: they "
                 "vary by tens of percent with the load, so compare CPU seconds (one torch "
                 "thread per row) where given.")  # fmt: skip
    lines.append("")
    if pre:
        lines += ["## Public pretraining (non-private, 10% of the training set)", "",
                  "| model | checkpoint | size | public images | epochs (steps) | test acc (images) | time (s) | CPU (s) |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for p in pre:
            epochs = p.get("epochs", 3)
            cpu = f"{p['train_cpu_s']:.0f}" if "train_cpu_s" in p else "-"
            lines.append(f"| {p['model']} | {_pretrain_of(p)}: {PRETRAIN_LABELS[_pretrain_of(p)]} | "
                         f"{p['image_size']} | {p['train_examples']} | {epochs} ({p['steps']}) | "
                         f"{p['accuracy']:.3f} ({p['eval_n']}) | {p['train_time_s']:.0f} | {cpu} |")  # fmt: skip
        lines.append("")
    summary: dict = {"rows": {}, "checks": {}}
    if runs:
        lines += _runs_table(runs, summary)
    if scan:
        lines += ["## Step time and memory by image size (one step, batch "
                  f"{scan[0]['batch']}, {scan[0]['model']})", "",
                  "Each method in fresh workers, methods alternating within a size and rounds "
                  "repeating the scan; figures are medians over the newest run's rounds. Time: "
                  "median over the timed steps after the warm-up, default allocator. Step "
                  f"memory: peak RSS growth over {MEMORY_STEPS} steps after the warm-up (outside "
                  "the window), glibc's mmap threshold pinned (`PINNED_MALLOC`) so that RSS follows "
                  "the live tensors. Tensor peak: the most tensor bytes allocated during one "
                  "step live at once (torch profiler memory events), whatever the allocator "
                  "keeps. First design's memory: the earlier scan's figure (peak RSS growth over "
                  "warm-up and timed steps, default allocator), taken in the timing worker. "
                  "Rows with one round and no tensor peak are single runs of that first "
                  "design.", "",
                  "| size | method | rounds x timed steps | wall s/step | CPU s/step | "
                  "step memory (MB) | tensor peak (MB) | first design's memory, min-max (MB) "
                  "| load |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in sorted(scan, key=lambda r: (r["image_size"], SCAN_METHODS.index(r["method"]))):
            tensor = f"{r['tensor_peak_mb']:.1f}" if "tensor_peak_mb" in r else "-"
            load = f"{r['load_avg']:.1f}" if "load_avg" in r else "-"
            lo, hi = r.get("first_design_memory_range_mb", (None, None))
            first = "-" if lo is None else f"{lo:.1f}-{hi:.1f}"
            lines.append(f"| {r['image_size']} | {r['method']} | {r.get('rounds', 1)} x {r['steps']} | "
                         f"{r['wall_s_per_step']:.3f} | {r['cpu_s_per_step']:.3f} | "
                         f"{r['step_memory_mb']:.1f} | {tensor} | {first} | {load} |")  # fmt: skip
            summary.setdefault("scan", []).append(r)
        runs_used = sorted({r["run"] for r in scan if "run" in r})
        if runs_used:
            lines.append("")
            lines.append(f"Scan run(s): {', '.join(runs_used)}.")
        lines.append("")
        lines += _scan_ratios(scan, summary)
    shown = {(r["method"], r["image_size"], r["model"]) for r in scan}
    for r in scan_all:
        if "error" in r and (r["method"], r["image_size"], r["model"]) not in shown:
            lines.append(f"- scan {r['method']} at {r['image_size']}px failed: {r['error'][-200:]}")
    if runs or scan:
        _plot(summary, scan, RESULTS / "vision.png")
        lines.append(
            "Plot: `vision.png` (test accuracy per row and setting; step CPU time by size)."
        )
    (RESULTS / "vision.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "vision.json").write_text(json.dumps(summary, indent=2) + "\n")
    print("\n".join(lines))


def _mean_sd(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def _runs_table(runs: list[dict], summary: dict) -> list[str]:
    """One table per setting (model, private images, batch, epochs, size); mean over seeds."""
    settings: dict = {}
    variants = [r for r in runs if r.get("variant")]
    for r in runs:
        if r.get("variant"):
            continue
        setting = (r["model"], r["train_examples"], _batch(r), r["epochs"], r["image_size"],
                   _pretrain_of(r))  # fmt: skip
        settings.setdefault(setting, {}).setdefault((r["row"], r["eps"]), []).append(r)
    order = {k: i for i, k in enumerate(ROWS)}
    out: list[str] = []
    for (model, n, b, epochs, size, pre), groups in sorted(
        settings.items(), key=lambda kv: (kv[0][0], kv[0][5] == "legacy", -kv[0][1])
    ):
        name = f"{model}/n{n}/B{b}/e{epochs}/s{size}" + ("" if pre == "legacy" else f"/{pre}")
        any_r = next(iter(groups.values()))[0]
        out += [f"## {model}: private fine-tuning from the {pre} public checkpoint "
                f"({n} private images, logical batch {b}, {epochs} epochs, {size}x{size}, "
                f"{any_r['eval_n']} test images)", "",
                "| row | eps (spent) | seeds | test accuracy (mean ± sd) | train wall (s) "
                "| train CPU (s) | peak RSS (MB) | trainable | steps |",
                "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        rows: dict = {}
        for (row, eps), rs in sorted(
            groups.items(), key=lambda kv: (kv[0][1] or 0, order[kv[0][0]])
        ):
            accs = [r["accuracy"] for r in rs]
            t = statistics.mean(r["train_time_s"] for r in rs)
            cpus = [r["train_cpu_s"] for r in rs if "train_cpu_s" in r]
            cpu = statistics.mean(cpus) if cpus else None
            mem = statistics.mean(r["peak_rss_mb"] for r in rs)
            eps_s = (
                ("-" if row == "public-only" else "inf")
                if eps is None
                else f"{eps:g} ({statistics.mean(r['epsilon'] for r in rs):.2f})"
            )
            out.append(f"| {LABELS[row]} | {eps_s} | {len(rs)} | {_mean_sd(accs)} | {t:.0f} | "
                       f"{'-' if cpu is None else f'{cpu:.0f}'} | {mem:.0f} | "
                       f"{100 * rs[0]['trainable_fraction']:.2f}% | {rs[0]['steps']} |")  # fmt: skip
            rows[(row, eps)] = {"accuracy": statistics.mean(accs), "accuracies": accs,
                                "train_time_s": t, "train_cpu_s": cpu, "peak_rss_mb": mem,
                                "seeds": len(rs)}  # fmt: skip
        out.append("")
        summary["rows"][name] = {f"{row}/{eps}": v for (row, eps), v in rows.items()}
        out += _checks(model, name, rows, summary)
        out += _start_check(name, groups, summary)
    if variants:
        out += _variants_table(variants, summary)
    return out


def _start_check(name: str, groups: dict, summary: dict) -> list[str]:
    """dpfit train scores the checkpoint before training, on the images the row is scored on:
    per seed it must equal the checkpoint-alone row, an independent call of the same score."""
    public = {r["seed"]: r["accuracy"] for r in groups.get(("public-only", None), [])}
    pairs = [(r["start_accuracy"], public[r["seed"]]) for rs in groups.values() for r in rs
             if r.get("start_accuracy") is not None and r["seed"] in public]  # fmt: skip
    if not pairs:
        return []
    same = sum(abs(a - b) < 1e-9 for a, b in pairs)
    summary["checks"][f"{name}: start score equals the checkpoint-alone row"] = same == len(pairs)
    return [f"- dpfit train's own score of the checkpoint before training equals the "
            f"checkpoint-alone row of its seed in {same} of {len(pairs)} runs", ""]  # fmt: skip


def _variants_table(runs: list[dict], summary: dict) -> list[str]:
    """Rows run with other optimiser settings than the tables above (not in their targets)."""
    out = ["## Optimiser variants (other settings than the rows above; not in the targets)", "",
           "| model | checkpoint | private images | batch | row | variant | eps (spent) | seeds "
           "| test accuracy | train CPU (s) | steps |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    groups: dict = {}
    for r in runs:
        k = (r["model"], _pretrain_of(r), r["train_examples"], _batch(r), r["row"], r["variant"],
             r["eps"])  # fmt: skip
        groups.setdefault(k, []).append(r)
    for (model, pre, n, b, row, variant, eps), rs in sorted(groups.items(), key=str):
        accs = [r["accuracy"] for r in rs]
        cpu = statistics.mean(r.get("train_cpu_s", 0.0) for r in rs)
        eps_s = (
            "inf" if eps is None else f"{eps:g} ({statistics.mean(r['epsilon'] for r in rs):.2f})"
        )
        out.append(f"| {model} | {pre} | {n} | {b} | {LABELS[row]} | {variant} | {eps_s} "
                   f"| {len(rs)} | {_mean_sd(accs)} | {cpu:.0f} | {rs[0]['steps']} |")  # fmt: skip
        summary.setdefault("variants", {})[f"{model}/{pre}/n{n}/B{b}/{row}/{variant}/{eps}"] = accs
    notes = sorted({r["note"] for r in runs if r.get("note")})
    out += ["", *(f"- {n}" for n in notes)] if notes else []
    out.append("")
    return out


def _checks(model: str, name: str, rows: dict, summary: dict) -> list[str]:
    out = ["Targets and the paper's ordering (means over the seeds above):", ""]
    checks = summary["checks"]
    full8 = rows.get(("dp-full", 8.0))
    if full8 and model == "resnet-gn":
        ok = full8["accuracy"] >= 0.85
        checks[f"{name}: dp-full eps8 >= 0.85"] = ok
        out.append(f"- DP full at eps=8 reaches {full8['accuracy']:.3f} "
                   f"({'meets' if ok else 'misses'} the 0.85 target)")  # fmt: skip
    public = rows.get(("public-only", None))
    if public:
        ahead = []
        for (row, eps), r in rows.items():
            if eps is not None:
                gain = r["accuracy"] - public["accuracy"]
                checks[f"{name}: {row} eps{eps:g} above the checkpoint alone"] = gain > 0
                ahead.append(f"{LABELS[row]} eps={eps:g} {gain:+.3f}")
        out.append(f"- the public checkpoint alone scores {public['accuracy']:.3f} on the same "
                   "test images; each private row minus it: " + "; ".join(ahead))  # fmt: skip
    for eps in sorted({e for _, e in rows if e is not None}):
        r0, r1 = rows.get(("dp-bitfit", eps)), rows.get(("1+bitfit", eps))
        r2, full = rows.get(("2+bitfit", eps)), rows.get(("dp-full", eps))
        if r2 and full:
            close = r2["accuracy"] >= full["accuracy"] - 0.02
            wall = r2["train_time_s"] / full["train_time_s"]
            cpu = (r2["train_cpu_s"] / full["train_cpu_s"]
                   if r2["train_cpu_s"] and full["train_cpu_s"] else None)  # fmt: skip
            fast = (cpu if cpu is not None else wall) <= 0.7
            checks[f"{name}: 2+bitfit eps{eps:g} within 2 points of dp-full"] = close
            checks[f"{name}: 2+bitfit eps{eps:g} time <= 0.70 of dp-full"] = fast
            out.append(f"- eps={eps:g}: 2+BiTFiT {r2['accuracy']:.3f} vs DP full "
                       f"{full['accuracy']:.3f} ({'within' if close else 'not within'} 2 points); "
                       f"time 2+BiTFiT / DP full: CPU {'-' if cpu is None else f'{cpu:.2f}'}, "
                       f"wall {wall:.2f} ({'<=' if fast else '>'} 0.70)")  # fmt: skip
        if r0 and r1 and r2 and full:
            a = [r0["accuracy"], r1["accuracy"], r2["accuracy"], full["accuracy"]]
            holds = a[0] < a[1] < a[2] and abs(a[2] - a[3]) <= 0.02
            checks[f"{name}: paper ordering eps{eps:g}"] = holds
            # the paper's steps are tens of points; steps smaller than the seed-to-seed
            # spread (or with one seed, the ~1-point standard error of one accuracy on
            # 2,000 test images) are not evidence of an ordering
            rs = (r0, r1, r2)
            sds = [statistics.stdev(r["accuracies"]) for r in rs if len(r["accuracies"]) > 1]
            noise = max(sds) if len(sds) == len(rs) else 0.01
            clear = holds and min(a[1] - a[0], a[2] - a[1]) > noise
            checks[f"{name}: paper ordering eps{eps:g}, steps above seed noise"] = clear
            verdict = "does not hold"
            if holds:
                verdict = "holds, steps above the seed spread" if clear else (
                    f"holds on the means, but its steps ({a[1] - a[0]:+.3f}, "
                    f"{a[2] - a[1]:+.3f}) are within the seed spread ({noise:.3f}): not "
                    "distinguishable from noise")  # fmt: skip
            out.append(f"- eps={eps:g}: accuracy 0+ / 1+ / 2+ BiTFiT / DP full: "
                       + " / ".join(f"{x:.3f}" for x in a)
                       + f": the ordering 0+ < 1+ < 2+ ~ full (within 2 points) {verdict}")  # fmt: skip
    out.append("")
    return out


SCAN_FIELDS = ("wall_s_per_step", "cpu_s_per_step", "step_memory_mb", "tensor_peak_mb",
               "first_design_memory_mb", "load_avg")  # fmt: skip


def _scan_rows(scan_all: list[dict]) -> list[dict]:
    """One row per (method, size, model): the median over the rounds of the newest run of the
    current scan design; failing that, the newest single row of the first design."""
    ok = [r for r in scan_all if "error" not in r]
    out = []
    for key in dict.fromkeys((r["method"], r["image_size"], r["model"]) for r in ok):
        rows = [r for r in ok if (r["method"], r["image_size"], r["model"]) == key]
        current = [r for r in rows if r.get("scan_version") == SCAN_VERSION]
        if not current:
            out.append(rows[-1])
            continue
        newest = max(current, key=lambda r: r["finished"])["run"]
        rounds = [r for r in current if r["run"] == newest]
        merged = {**rounds[-1], "rounds": len(rounds)}
        for f in SCAN_FIELDS:
            vals = [r[f] for r in rounds if f in r]
            if vals:
                merged[f] = statistics.median(vals)
        first = [r["first_design_memory_mb"] for r in rounds if "first_design_memory_mb" in r]
        if first:
            merged["first_design_memory_range_mb"] = (min(first), max(first))
        out.append(merged)
    return out


def _scan_ratios(scan: list[dict], summary: dict) -> list[str]:
    out = ["### DP-BiTFiT / non-private bias-only, and DP full / DP-BiTFiT", ""]
    by = {(r["image_size"], r["method"]): r for r in scan}
    for size in sorted({r["image_size"] for r in scan}):
        a, b = by.get((size, "dpfit-bitfit")), by.get((size, "nonpriv-bias"))
        if a and b:
            tr = a["cpu_s_per_step"] / b["cpu_s_per_step"]
            mr = a["step_memory_mb"] / max(b["step_memory_mb"], 1e-9)
            summary["checks"][f"bitfit/nonpriv-bias at {size}: time<=1.05"] = tr <= 1.05
            summary["checks"][f"bitfit/nonpriv-bias at {size}: memory<=1.05"] = mr <= 1.05
            line = (
                f"- {size}px: DP-BiTFiT / non-private bias-only: CPU time {tr:.2f}, memory {mr:.2f}"
            )
            if "tensor_peak_mb" in a and "tensor_peak_mb" in b:
                line += f", tensor peak {a['tensor_peak_mb'] / max(b['tensor_peak_mb'], 1e-9):.3f}"
            if "first_design_memory_mb" in a and "first_design_memory_mb" in b:
                first = a["first_design_memory_mb"] / max(b["first_design_memory_mb"], 1e-9)
                line += f" (first design's memory figure: {first:.2f})"
            for other in ("dpfit-full", "opacus-full"):
                o = by.get((size, other))
                if o:
                    line += f"; {other} / DP-BiTFiT time {o['cpu_s_per_step'] / a['cpu_s_per_step']:.2f}"
            out.append(line)
    out.append("")
    return out


def _plot(summary: dict, scan: list[dict], path: Path) -> None:
    """One accuracy panel per setting (rows on x, one series per epsilon, mean and every
    seed), and CPU s/step against image size for each scan method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(summary["rows"].items())
    panels = len(settings) + (1 if scan else 0)
    cols = min(3, panels)
    rows_n = -(-panels // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.2 * cols, 3.9 * rows_n), squeeze=False)
    flat = list(axes.flat)
    for ax, (name, rows) in zip(flat, settings, strict=False):
        for k, eps in enumerate(sorted({key.split("/")[1] for key in rows}, reverse=True)):
            xs, means, seeds = [], [], []
            for i, row in enumerate(ROWS):
                v = rows.get(f"{row}/{eps}")
                if v is None:
                    continue
                x = i + 0.12 * (k - 1)
                xs.append(x)
                means.append(v["accuracy"])
                seeds += [(x, a) for a in v["accuracies"]]
            label = "non-private" if eps == "None" else f"eps {float(eps):g}"
            color = {"None": "C0", "8.0": "C1", "2.0": "C2"}.get(eps, f"C{k + 3}")
            ax.plot(xs, means, "o", label=label, color=color)
            ax.plot([x for x, _ in seeds], [a for _, a in seeds], ".", alpha=0.35,
                    color=color)  # fmt: skip
        ax.set_xticks(range(len(ROWS)))
        ax.set_xticklabels([LABELS[r].replace(" (", "\n(") for r in ROWS], rotation=60,
                           fontsize=7, ha="right")  # fmt: skip
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("test accuracy")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if scan:
        ax = flat[len(settings)]
        for method in SCAN_METHODS:
            pts = sorted(
                (r["image_size"], r["cpu_s_per_step"]) for r in scan if r["method"] == method
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), "o-", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("image size (px)")
        ax.set_ylabel("CPU s / step (median)")
        ax.set_title(f"one step, batch {scan[0]['batch']}, {scan[0]['model']}", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    for ax in flat[panels:]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------- plumbing
def _spawn(spec: dict, extra_env: dict | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(_threads()), **(extra_env or {})}
    src = str(HERE.parent / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, __file__, "_worker", json.dumps(spec)]
    return run_json_worker(cmd, env, label=f" ({spec})")


def _evaluate_worker(spec: dict) -> dict:
    """The checkpoint alone on the test images a training row with this seed is scored on."""
    import torch

    from dpfit.tasks.image_classification import evaluate_images
    from dpfit.vision.data import load_fashion_mnist
    from dpfit.vision.models import load_image_model, read_record

    torch.set_num_threads(_threads())
    model = load_image_model(spec["evaluate"]["model"])
    test = load_fashion_mnist("test")
    n = spec["image"].get("max_eval_examples")
    if n is not None and n < len(test):  # the subset dpfit train scores (same call, same seed)
        test = test.subsample(n, seed=spec["evaluate"]["seed"])
    res = evaluate_images(model, test)
    n_private = spec["evaluate"]["private_examples"]
    if n_private is None:  # all of the private side, as the training rows then use
        n_private = read_record(spec["evaluate"]["model"])["pretrained_on"]["n_private"]
    return {"accuracy": res["accuracy"], "eval_n": res["n"], "epsilon": None, "steps": 0,
            "train_examples": n_private,
            "train_time_s": 0.0, "train_cpu_s": 0.0, "trainable_fraction": 0.0,
            "peak_rss_mb": peak_rss() / 2**20, "threads": _threads()}  # fmt: skip


def _worker(spec: dict) -> None:
    if spec["kind"] == "scan":
        out = _scan_worker(spec)
    elif spec["kind"] == "evaluate":
        out = _evaluate_worker(spec)
    else:
        out = _train_worker(spec)
    print(json.dumps(out))


def _append(path: Path, row: dict) -> None:
    row = {**row, "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    append_jsonl(path, row, durable=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("utility")
    u.add_argument("--models", nargs="+", default=["resnet-gn", "vit-tiny"])
    u.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    u.add_argument("--eps", nargs="+", type=float, default=[8.0, 2.0])
    u.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    u.add_argument("--epochs", type=int, default=3)
    u.add_argument("--pretrain", choices=sorted(PRETRAINS), default="default",
                   help="the public checkpoint's recipe (legacy: the first rows' 3 epochs)")  # fmt: skip
    u.add_argument("--batch-size", type=int, default=64)
    u.add_argument("--physical-batch-size", type=int, default=64)
    u.add_argument("--max-grad-norm", type=float, default=1.0)
    u.add_argument(
        "--lr-full", type=float, help=f"lr of phases that train every weight ({LR_FULL:g})"
    )
    u.add_argument("--lr-schedule", default="constant", choices=("constant", "cosine"))
    u.add_argument("--clipping", default="flat", choices=("flat", "automatic"))
    u.add_argument("--private-examples", type=int, default=1_000)
    u.add_argument("--eval-examples", type=int, default=2_000)
    u.add_argument("--image-size", type=int, default=28)
    u.add_argument("--work", default=os.environ.get("DPFIT_BENCH_WORK", "/tmp/dpfit-vision-bench"))
    s = sub.add_parser("scan")
    s.add_argument("--sizes", nargs="+", type=int, default=[28, 56, 112])
    s.add_argument("--model", default="resnet-gn")
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--steps", type=int, default=2, help="timed steps (after the warm-up)")
    s.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps first, outside the "
        "memory window (the first step's one-time set-up, the optimizer's state)",
    )
    s.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the whole scan; the report "
        "takes each method's median over the rounds of the newest run",
    )
    s.add_argument("--run", default=None, help="resume this run (default: a new one)")
    s.add_argument("--methods", nargs="+", default=list(SCAN_METHODS), choices=SCAN_METHODS)
    sub.add_parser("report")
    w = sub.add_parser("_worker")
    w.add_argument("spec")
    args = p.parse_args(argv)
    if args.cmd == "_worker":
        _worker(json.loads(args.spec))
    elif args.cmd == "utility":
        cmd_utility(args)
    elif args.cmd == "scan":
        cmd_scan(args)
    else:
        cmd_report(args)


if __name__ == "__main__":
    main()

"""Does a private run with the defaults end at or above the trained checkpoint it starts from?

One question: from a model already trained (non-privately, on public images) for the task,
``dpfit train``'s defaults at eps 8 (the recipe detects the trained start: no head-first,
rates lr = walk / sqrt(phase steps), dpfit.recipe) end at or above the checkpoint's own
accuracy on the same evaluation images, within the seed spread.

Tasks (npz files built here from data on this machine; nothing is downloaded):

    fmnist-5k    FashionMNIST: a seeded 6,000 training images are public (the checkpoint,
                 `dpfit pretrain` with --epochs 10), 5,000 others private; validation: 2,000
                 more training images; test: a seeded 2,000 of the official test split
    fmnist-500   the same checkpoint, 500 private images
    digits-500   scikit-learn's 8x8 digits (1,797 images, upsampled to 16x16): 200 public
                 (checkpoint with `dpfit pretrain`'s defaults), 500 private, 300 validation,
                 the other 797 test

Rows: ``dp-full`` (--mode full) and ``1+bitfit`` (--full-epochs 1: one epoch of every
weight, then biases + head), eps 8. Variants: ``default`` (no recipe field set: the rule
for a trained start, walks dpfit.recipe.TRAINED_WALK) and ``before`` (the fresh-start rates
the recipe gave before it knew the start: DP full lr 5e-4; 1+BiTFiT 5e-3 for both phases,
every weight included) and ``walk/k`` (k = 3, 10, 30, 100, 300: the rule's rates at walks
REF_WALK / k, REF_WALK the rule's first constants, 1e-3 for every weight and 1e-2 for
biases + head). TRAINED_WALK is chosen on the validation split (``--split val``, 3 seeds)
by the criterion of :func:`_choice`, fixed before the test split ran with it; the test
split is then scored with the defaults (``--split test``). Each run is one fresh worker
process (one torch thread), appended to ``results/checkpoint_recipe.jsonl`` with the
TRAINED_WALK it ran under; a run already there with the same walks is skipped.

    nice -n 10 python benchmarks/checkpoint_recipe.py run --split val --seeds 0 1 2 \
        --variants walk/3 walk/10 walk/30
    nice -n 10 python benchmarks/checkpoint_recipe.py run --split test --seeds 0 1 2
    python benchmarks/checkpoint_recipe.py report   # results/checkpoint_recipe.md, docs/vision.md
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness.records import append_jsonl, read_jsonl
from harness.render import write_between_markers
from harness.workers import run_json_worker

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # this checkout's dpfit, as in the workers
RESULTS = HERE / "results"
RUNS = RESULTS / "checkpoint_recipe.jsonl"
TASKS = ("fmnist-5k", "fmnist-500", "digits-500")
ROWS = ("dp-full", "1+bitfit")
# walk/k: REF_WALK / k. REF_WALK is fixed (the rule's first constants), so a variant names
# the same walks whatever TRAINED_WALK is now, and seeds added later join their group.
REF_WALK = {"full": 1e-3, "bias": 1e-2}
WALK_SCALE = {f"walk/{k}": 1 / k for k in (3, 10, 30, 100, 300)}
# flat,walk/k: the same rates with flat clipping at the recipe's R instead of automatic
# clipping (which scales every example's gradient to about norm R, the many small gradients
# of examples a trained model already gets right included)
FLAT = {f"flat,{w}": w for w in WALK_SCALE}
VARIANTS = ("default", "before", *WALK_SCALE, *FLAT)
# the rule's constant is chosen among these (_choice)
CANDIDATES = tuple(WALK_SCALE)
MIN_SEEDS = 3  # a validation row takes part in the choice with at least this many seeds
DOC_MARKERS = ("<!-- checkpoint_recipe:begin -->", "<!-- checkpoint_recipe:end -->")
EPS = 8.0
FMNIST_PRETRAIN_EPOCHS = 10  # CPU budget: dpfit pretrain's own rule would take 40 here
# the fresh-start rates (dpfit.recipe.PRIVATE_LR): what a trained start got before
BEFORE = {"dp-full": {"lr": 5e-4}, "1+bitfit": {"lr": 5e-3, "full_lr": 5e-3}}


def _source(task: str) -> str:
    return "digits" if task.startswith("digits") else "fmnist"


def _private_n(task: str) -> int:
    return {"fmnist-5k": 5000, "fmnist-500": 500, "digits-500": 500}[task]


def build_data(work: Path) -> None:
    """Seeded disjoint splits as .npz files (idempotent)."""
    import numpy as np

    work.mkdir(parents=True, exist_ok=True)
    if (work / "digits_test.npz").is_file():
        return
    from dpfit.vision.data import load_fashion_mnist

    rng = np.random.default_rng(0)
    train, test = load_fashion_mnist("train"), load_fashion_mnist("test")
    names = np.array(train.label_names)
    order = rng.permutation(len(train.labels))
    parts = {"public": order[:6000], "val": order[6000:8000], "private": order[8000:13000]}
    for name, idx in parts.items():
        np.savez(work / f"fmnist_{name}.npz", images=train.images[idx],
                 labels=train.labels[idx], label_names=names)  # fmt: skip
    t = rng.permutation(len(test.labels))[:2000]
    np.savez(work / "fmnist_test.npz", images=test.images[t], labels=test.labels[t],
             label_names=names)  # fmt: skip
    from sklearn.datasets import load_digits

    d = load_digits()
    images = np.round(d.images * (255 / 16)).astype(np.uint8)
    order = rng.permutation(len(d.target))
    digits = {"public": order[:200], "private": order[200:700], "val": order[700:1000],
              "test": order[1000:]}  # fmt: skip
    for name, idx in digits.items():
        np.savez(work / f"digits_{name}.npz", images=images[idx], labels=d.target[idx],
                 label_names=np.array([str(i) for i in range(10)]))  # fmt: skip


def _checkpoint(source: str, work: Path) -> Path:
    """The public checkpoint of a source, pretrained once (cached in the work folder)."""
    out = work / f"pretrained-{source}"
    if (out / "model" / "dpfit-vision.json").is_file():
        return out / "model"
    spec = {
        "kind": "pretrain",
        "train": dict(task="image-classification", model="resnet-gn", non_private=True,
                      epsilon=None, mode="full", data=str(work / f"{source}_public.npz"),
                      eval_data=str(work / f"{source}_val.npz"), public_labels=True,
                      output=str(out),
                      epochs=FMNIST_PRETRAIN_EPOCHS if source == "fmnist" else None),
        "image": dict(split="public", image_size=16 if source == "digits" else 28),
    }  # fmt: skip
    res = _spawn(spec)
    _append({"kind": "pretrain", "source": source, **res})
    return out / "model"


def run_spec(task: str, row: str, variant: str, seed: int, split: str, work: Path) -> dict:
    source = _source(task)
    model = _checkpoint(source, work)
    train = dict(
        task="image-classification", model=str(model), epsilon=EPS, seed=seed,
        data=str(work / f"{source}_private.npz"), eval_data=str(work / f"{source}_{split}.npz"),
        max_train_examples=_private_n(task), public_labels=True,
    )  # fmt: skip
    if row == "dp-full":
        train["mode"] = "full"
    else:
        train["full_epochs"] = 1
    if variant == "before":
        train.update(BEFORE[row])
    if variant in FLAT:
        train["clipping"] = "flat"
        variant = FLAT[variant]
    if variant in WALK_SCALE:  # the rule's own rates, at walks REF_WALK / k
        from dpfit.recipe import TRAINED_WALK

        r = _recipe(task, row)
        mode = train.get("mode", "bias")
        train["lr"] = r.lr * REF_WALK[mode] / TRAINED_WALK[mode] * WALK_SCALE[variant]
        if r.full_lr is not None:
            train["full_lr"] = r.full_lr * REF_WALK["full"] / TRAINED_WALK["full"]
            train["full_lr"] *= WALK_SCALE[variant]
    return {"kind": "train", "train": train, "image": {}}


def _recipe(task: str, row: str):
    """What the recipe gives a row from a trained start (the worker's train resolves the same)."""
    from dpfit.recipe import default_delta, resolve_recipe

    n = _private_n(task)
    mode, full_epochs = ("full", 0) if row == "dp-full" else ("bias", 1)
    return resolve_recipe(n, 10, EPS, default_delta(n), 0, mode, start="trained",
                          full_epochs=full_epochs, tokens=False)  # fmt: skip


def _planned_walks(task: str, row: str, variant: str, spec: dict) -> str:
    """The walks a run will take, as :func:`_walks` reads them off a recorded run."""
    r = _recipe(task, row)
    t = spec["train"]
    planned = dict(row=row, lr=t.get("lr", r.lr), full_lr=t.get("full_lr", r.full_lr),
                   steps=r.epochs * max(1, round(_private_n(task) / r.batch_size)),
                   train_examples=_private_n(task), batch_size=r.batch_size)  # fmt: skip
    return _walks(planned)


def _spawn(spec: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent / "src")}
    return run_json_worker([sys.executable, __file__, "_worker", json.dumps(spec)], env)


def _worker(spec: dict) -> None:
    import torch

    from dpfit.tasks.image_classification import ImageOptions
    from dpfit.train import TrainConfig, train
    from dpfit.vision.pretrain import PRETRAIN_DEFAULTS, pretrain

    torch.set_num_threads(1)
    notes: list[str] = []
    cpu: dict = {}

    def on_note(msg: str) -> None:
        notes.append(msg)
        if msg.startswith("recipe") or msg.startswith("accuracy of the starting model"):
            cpu["start"] = time.process_time()  # training starts after these

    def on_step(row, total: int) -> None:
        cpu["end"] = time.process_time()

    if spec["kind"] == "pretrain":
        recipe = dict(PRETRAIN_DEFAULTS)
        spec["image"]["augment"] = recipe.pop("augment")
        recipe.pop("epochs")
        spec["train"] = {**recipe, **spec["train"]}
    paired = spec["kind"] == "train"
    out_dir = tempfile.TemporaryDirectory() if paired else None
    if paired:  # the trained model is saved, then read back to compare with its start
        spec["train"]["output"] = out_dir.name
    config = TrainConfig(**spec["train"], task_options=ImageOptions(**spec["image"]))
    run = pretrain if spec["kind"] == "pretrain" else train
    m = run(config, on_step=on_step, on_note=on_note).metrics
    keep = ("accuracy", "eval_n", "start_accuracy", "epsilon", "noise_multiplier", "sample_rate",
            "steps", "train_examples", "batch_size", "epochs", "lr", "full_lr", "mode")  # fmt: skip
    res = {k: m.get(k) for k in keep}
    res["recipe_note"] = next((n for n in notes if n.startswith("recipe")), "")
    res["train_cpu_s"] = cpu.get("end", 0.0) - cpu.get("start", 0.0)
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    res["load_avg"] = os.getloadavg()[0]
    res["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if paired:
        start = Path(spec["train"]["model"])
        res["checkpoint"] = checkpoint_id(start)
        res["flips"] = flips(start, Path(out_dir.name) / "model", spec["train"]["eval_data"])
        correct = res["flips"]["correct_end"]
        if abs(correct / m["eval_n"] - m["accuracy"]) > 1e-9:  # the same images, scored alike
            raise SystemExit(f"paired count {correct} disagrees with accuracy {m['accuracy']}")
        out_dir.cleanup()
    print(json.dumps(res))


def checkpoint_id(model_dir: Path) -> str:
    """The checkpoint a run started from, by the hash of its weights: rows from a checkpoint
    trained again (same command, other floating-point path) are told apart."""
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()[:12]


def flips(start: Path, end: Path, eval_data: str) -> dict:
    """Image by image, start against end on the evaluation images: those the run lost (right
    at the start, wrong at the end) and gained, for a paired (McNemar) test of end - start."""
    from dpfit.tasks.image_classification import predict_images
    from dpfit.vision.data import load_images, relabel
    from dpfit.vision.models import load_image_model

    a, b = load_image_model(start), load_image_model(end)
    data = load_images(eval_data, "train", a.spec.label_names, image_size=a.spec.image_size,
                       channels=a.spec.in_channels)  # fmt: skip
    data = relabel(data, a.spec.label_names)
    right_a = predict_images(a, data) == data.labels
    right_b = predict_images(b, data) == data.labels
    return {"lost": int((right_a & ~right_b).sum()), "gained": int((~right_a & right_b).sum()),
            "correct_start": int(right_a.sum()), "correct_end": int(right_b.sum())}  # fmt: skip


def mcnemar_p(lost: int, gained: int) -> float:
    """Exact two-sided McNemar p-value: under no change, each changed image is lost or gained
    with probability 1/2 (a binomial sign test on the discordant images)."""
    n, k = lost + gained, min(lost, gained)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n)


def _read() -> list[dict]:
    return read_jsonl(RUNS)


def _append(row: dict) -> None:
    append_jsonl(RUNS, row)


def _key(r: dict, walks: str) -> tuple:
    """A run is done when one of the same task, row, variant, seed and split took the same
    walks from the same checkpoint: a `default` run recorded under other constants, or from
    a checkpoint trained again (or not identified: rows from before the hash was recorded),
    does not count."""
    return (r.get("task"), r.get("row"), r.get("variant"), r.get("seed"), r.get("split"), walks,
            r.get("checkpoint"))  # fmt: skip


def cmd_run(args) -> None:
    work = Path(args.work)
    build_data(work)
    from dpfit.recipe import TRAINED_WALK

    done = {_key(r, _walks(r)) for r in _read() if r.get("kind") == "train"}
    for split in args.split:
        for seed in args.seeds:
            for task in args.tasks:
                for row in args.rows:
                    for variant in args.variants:
                        key = dict(task=task, row=row, variant=variant, seed=seed, split=split)
                        spec = run_spec(task, row, variant, seed, split, work)
                        key["checkpoint"] = checkpoint_id(Path(spec["train"]["model"]))
                        if _key(key, _planned_walks(task, row, variant, spec)) in done:
                            continue
                        print(f"run {key}", flush=True)
                        res = _spawn(spec)
                        _append({"kind": "train", **key, "command": args.command_line,
                                 "trained_walk": {k: TRAINED_WALK[k] for k in ("full", "bias")},
                                 **res})  # fmt: skip
                        print(f"  start {res['start_accuracy']:.4f} -> {res['accuracy']:.4f}, "
                              f"{res['train_cpu_s']:.0f} CPU s", flush=True)  # fmt: skip


def _walks(r: dict) -> str:
    """The noise walks lr sqrt(T) a run's rates give (every weight, biases + head), from what
    it recorded: rows from before the rule's constants were fixed read the same way."""
    if r["row"] == "dp-full":
        return f"{r['lr'] * math.sqrt(r['steps']):.2g}, -"
    per_epoch = max(1, round(r["train_examples"] / r["batch_size"]))
    full = r["full_lr"] * math.sqrt(per_epoch)
    return f"{full:.2g}, {r['lr'] * math.sqrt(r['steps'] - per_epoch):.2g}"


def _ms(xs: list[float]) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}"


def _gap(rs: list[dict]) -> tuple[float, float]:
    """Mean end - start over seeds and the seed sd of the end (0 with one seed)."""
    end = [r["accuracy"] for r in rs]
    gap = statistics.mean(r["accuracy"] - r["start_accuracy"] for r in rs)
    return gap, statistics.stdev(end) if len(end) > 1 else 0.0


def _met(rs: list[dict]) -> bool:
    """The target and the choice's criterion: mean end - start >= -(seed sd of the end)."""
    gap, spread = _gap(rs)
    return gap >= -spread


def _ref_walks(variant: str) -> str:
    k = WALK_SCALE[variant]
    return f"{REF_WALK['full'] * k:.2g}, {REF_WALK['bias'] * k:.2g}"


def _choice(train: list[dict]) -> tuple[list[str], str | None, list[str]]:
    """The rule's constant from the validation split alone, by a criterion fixed before the
    test split ran with it: the largest candidate walk that, on every task and row with at
    least MIN_SEEDS seeds, ends at or above its start within the seed spread. A larger
    candidate that is not yet decided (too few seeds and no row missed) leaves no choice."""
    val = [r for r in train if r["split"] == "val"]
    lines = [
        "| candidate | walk (weights, biases) | task | row | seeds | end - start (mean) | "
        "seed sd of the end | criterion |",
        "|---|---|---|---|---|---|---|---|",
    ]
    chosen, decided, summary = None, True, []
    for variant in CANDIDATES:
        statuses, gaps = [], []
        for task in TASKS:
            for row in ROWS:
                rs = [r for r in val if (r["task"], r["row"], r["variant"]) == (task, row, variant)]
                if len(rs) < MIN_SEEDS:
                    statuses.append("open")
                    lines.append(f"| {variant} | {_ref_walks(variant)} | {task} | {row} | "
                                 f"{len(rs)} | - | - | too few seeds |")  # fmt: skip
                    continue
                gap, spread = _gap(rs)
                statuses.append("met" if _met(rs) else "missed")
                gaps.append((gap, f"{task} {row}"))
                lines.append(f"| {variant} | {_ref_walks(variant)} | {task} | {row} | {len(rs)} | "
                             f"{gap:+.4f} | {spread:.4f} | {statuses[-1]} |")  # fmt: skip
        worst = f"{min(gaps)[1]} {min(gaps)[0]:+.4f}" if gaps else "-"
        met, ran = statuses.count("met"), len(statuses) - statuses.count("open")
        left = len(statuses) - ran
        rows = f"{met} of {ran}" + (f" ({left} not yet run)" if left else "")
        if not ran:
            rows = "not run" + (" (a larger walk is chosen)" if chosen else "")
        summary.append(f"| {variant} | {_ref_walks(variant)} | {rows} | {worst} |")
        if not decided or chosen:
            continue
        if "missed" in statuses:
            continue
        if "open" in statuses:
            decided = False
            continue
        chosen = variant
    return lines, chosen, summary


def _latest_checkpoints(train: list[dict]) -> dict[str, str]:
    """Each task's checkpoint as its newest identified run recorded it ("" where no run
    recorded one): earlier checkpoints' test rows are superseded, not the verdict."""
    latest: dict[str, str] = {}
    for r in sorted(train, key=lambda r: r.get("finished", "")):
        if r.get("checkpoint"):
            latest[r["task"]] = r["checkpoint"]
    return latest


def _paired(rs: list[dict]) -> str:
    """Per seed, the images the run lost and gained against its start, with the exact
    McNemar p of the two counts ("-" for runs from before they were recorded)."""
    if not all("flips" in r for r in rs):
        return "-"
    return ", ".join(f"{r['flips']['lost']} / {r['flips']['gained']} "
                     f"({mcnemar_p(r['flips']['lost'], r['flips']['gained']):.2f})"
                     for r in rs)  # fmt: skip


def render(runs: list[dict]) -> tuple[str, str]:
    """results/checkpoint_recipe.md and the block of docs/vision.md between DOC_MARKERS, from
    the recorded runs (pure: tests compare them with the committed files)."""
    from dpfit.recipe import TRAINED_WALK

    pre = [r for r in runs if r.get("kind") == "pretrain"]
    train = [r for r in runs if r.get("kind") == "train"]
    lines = [
        "# From a trained checkpoint: private runs with the defaults against their start",
        "",
        "Produced by `benchmarks/checkpoint_recipe.py` (raw rows, each with its command: "
        "`checkpoint_recipe.jsonl`; rows run since the walks were recorded also carry the "
        "recipe's `trained_walk`). resnet-gn, eps 8, one torch thread per run, under "
        "`nice -n 10` on a 2-core machine shared with other jobs. *start*: the checkpoint's "
        "accuracy on the same evaluation images, scored by `dpfit train` before training. "
        "Target: end >= start within the seed spread (mean end - start >= -(seed sd of the "
        "end)). *walk*: lr sqrt(phase steps), the distance the noise alone moves a coordinate "
        "under DP-Adam (dpfit.recipe), read off each run's recorded rates. `walk/k`: "
        f"({REF_WALK['full']:g}, {REF_WALK['bias']:g}) / k, the rule's first constants divided; "
        "`default`: the recipe's `TRAINED_WALK` when the row ran (validation `default` rows "
        "ran with the first constants, test rows marked *superseded* with an earlier choice). "
        "*checkpoint*: the start's weights hash (rows since it was recorded); test rows from "
        "a checkpoint since trained again (same command, this CPU) are marked *earlier "
        "checkpoint*. *images lost / gained*: image by image, right at the start and wrong at "
        "the end, and the reverse; McNemar p: the exact two-sided sign test on those two "
        "counts (rows since they were recorded).",
        "",
        "## Public checkpoints",
        "",
        "| source | public images | epochs | validation accuracy | train CPU (s) |",
        "|---|---|---|---|---|",
    ]
    for r in pre:
        lines.append(f"| {r['source']} | {r['train_examples']} | {r['epochs']} | "
                     f"{r['accuracy']:.3f} | {r['train_cpu_s']:.0f} |")  # fmt: skip
    now = {(t, w): _planned_walks(t, w, "default", {"train": {}}) for t in TASKS for w in ROWS}
    latest = _latest_checkpoints(train)
    verdicts, superseded, doc, images = [], [], [], {}
    for split in ("val", "test"):
        rows = [r for r in train if r["split"] == split]
        if not rows:
            continue
        title = "validation split (rule check)" if split == "val" else "test split (defaults)"
        lines += ["", f"## {title}", "",
                  "| task | private n | row | variant | checkpoint | walk (weights, biases) | "
                  "seeds | lr (full phase) | start | end | end - start (per seed) | "
                  "images lost / gained (McNemar p), per seed | train CPU s (mean) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        groups: dict = {}
        for r in rows:  # a variant's rates changed with the rule: group by what ran, and from
            key = (r["task"], r["row"], r["variant"], _walks(r), r.get("checkpoint") or "")
            groups.setdefault(key, []).append(r)  # which checkpoint
        order = sorted(groups, key=lambda k: (k[0], k[1], VARIANTS.index(k[2]), k[3], k[4]))
        for (task, row, variant, walks, ckpt), rs in ((k, groups[k]) for k in order):
            rs.sort(key=lambda r: r["seed"])
            start = [r["start_accuracy"] for r in rs]
            end = [r["accuracy"] for r in rs]
            diff = [e - s for s, e in zip(start, end, strict=True)]
            lr = f"{rs[0]['lr']:.3g}" + (f" ({rs[0]['full_lr']:.3g})" if rs[0]["full_lr"] else "")
            cpu = statistics.mean(r["train_cpu_s"] for r in rs)
            old = split == "test" and variant == "default" and walks != now[(task, row)]
            earlier = ckpt != latest.get(task, "")  # a checkpoint trained again since
            label = ("default (superseded)" if old else
                     "default (earlier checkpoint)" if earlier and variant == "default"
                     else variant)  # fmt: skip
            per_seed = ", ".join(f"{d:+.4f}" for d in diff)
            paired = _paired(rs)
            lines.append(
                f"| {task} | {rs[0]['train_examples']} | {row} | {label} | {ckpt or '-'} | "
                f"{walks} | {len(rs)} | {lr} | {_ms(start)} | {_ms(end)} | {per_seed} | "
                f"{paired} | {cpu:.0f} |"
            )
            if split == "test" and variant == "default":
                gap, spread = _gap(rs)
                verdict = (f"- {task} {row} (walks {walks}, checkpoint {ckpt or 'not recorded'}, "
                           f"{len(rs)} seed{'s' if len(rs) > 1 else ''}): end - start "
                           f"{gap:+.4f} (mean), seed sd of the end {spread:.4f}: "
                           f"{'met' if _met(rs) else 'missed'}"
                           + (f"; images lost / gained per seed: {paired}" if paired != "-"
                              else ""))  # fmt: skip
                (superseded if old or earlier else verdicts).append(verdict)
                if not (old or earlier):
                    images[task] = rs[0]["eval_n"]
                    doc.append(f"| {task} | {row} | {walks} | {len(rs)} | {_ms(start)} | "
                               f"{_ms(end)} | {per_seed} | {paired} | "
                               f"{'met' if _met(rs) else 'missed'} |")  # fmt: skip
    table, chosen, summary = _choice(train)
    current = f"{TRAINED_WALK['full']:g}, {TRAINED_WALK['bias']:g}"
    if chosen is None:
        pick = "no candidate chosen yet (a larger candidate is undecided or none met it)"
    else:
        match = _ref_walks(chosen) == f"{TRAINED_WALK['full']:.2g}, {TRAINED_WALK['bias']:.2g}"
        pick = (f"chosen: {chosen}, walks ({_ref_walks(chosen)}); `dpfit.recipe.TRAINED_WALK` "
                f"is ({current}): {'the choice' if match else 'NOT the choice'}")  # fmt: skip
    lines += ["", "## The rule's constant, chosen on the validation split", "",
              f"Criterion (fixed before the test split ran with the choice): of the candidates "
              f"{', '.join(CANDIDATES)}, the largest walk that on every task and row, with at "
              f"least {MIN_SEEDS} validation seeds, meets the target (mean end - start >= -(seed "
              "sd of the end)). The test split plays no part in it.", "", *table, "",
              f"Result: {pick}."]  # fmt: skip
    if verdicts:
        lines += ["", f"Target (test split, defaults: walks {current}):", "", *verdicts]
    if superseded:
        lines += ["", "Superseded (test split: the defaults of an earlier choice, or from an "
                  "earlier checkpoint):", "",
                  *superseded]  # fmt: skip
    commands = sorted({r["command"] for r in train if r.get("command")})
    lines += ["", "Commands (each under `nice -n 10`; a run already recorded is skipped, so a "
              "command stopped part-way and rerun adds only the missing rows):", "",
              *(f"    {c}" for c in commands)]  # fmt: skip
    cpu_total = sum(r.get("train_cpu_s", 0) for r in runs)
    lines += ["", f"Runs: {len(train)} private runs, {len(pre)} pretraining runs; training-loop "
              f"CPU over all of them {cpu_total / 60:.1f} min (each worker's start-up, data loading "
              "and the two evaluations come on top).", ""]  # fmt: skip
    scale = ", ".join(f"{t} {n} ({1 / n:.4f} an image)" for t, n in sorted(images.items()))
    what = f"walks {current}; test images: {scale}"
    block = [f"Test split, the defaults ({what}; mean ± sd over seeds):", "",
             "| task | row | walk (weights, biases) | seeds | start | end | "
             "end - start per seed | images lost / gained (McNemar p) per seed | target |",
             "|---|---|---|---|---|---|---|---|---|",
             *doc, "", f"Validation, {MIN_SEEDS} seeds (the choice; every row in "
             "checkpoint_recipe.md):", "",
             "| candidate | walk (weights, biases) | task rows that met the target | "
             "lowest mean end - start |", "|---|---|---|---|", *summary, "",
             f"Result: {pick}."]  # fmt: skip
    return "\n".join(lines), "\n".join(block)


def cmd_report(args) -> None:
    md, block = render(_read())
    (RESULTS / "checkpoint_recipe.md").write_text(md)
    print(md)
    write_between_markers(HERE.parent / "docs" / "vision.md", DOC_MARKERS, block)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "_worker":
        _worker(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--split", nargs="+", default=["val"], choices=("val", "test"))
    r.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    r.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    r.add_argument("--variants", nargs="+", default=["default"], choices=VARIANTS)
    r.add_argument("--seeds", nargs="+", type=int, default=[0])
    r.add_argument("--work", default=os.environ.get("DPFIT_BENCH_WORK", "/tmp/dpfit-ckpt-bench"))
    sub.add_parser("report")
    args = p.parse_args()
    args.command_line = "python benchmarks/checkpoint_recipe.py " + " ".join(sys.argv[1:])
    {"run": cmd_run, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()

"""Search for a default-recipe RULE (not per-task values) for bias-only training, DP and not.

Runs today's `dpfit.train.train` on the bundled tasks (dpfit.data.tasks), with the training
split subsampled (--n) and the test split capped (--test-n) so one run takes minutes on a
shared CPU. Every run appends one JSON line to the log (resumable: a run whose key is already
in the log is skipped), so a partial search still has results. `--pooling mean` swaps the
model's head for mean pooling + linear (what the frozen probes suggest may matter); this is
done by handing `train` a different model loader and is only for this search.

    python benchmarks/archive/recipe_search.py --grid np-ref            # non-private references
    python benchmarks/archive/recipe_search.py --grid dp-core --tasks rotten-tomatoes
    python benchmarks/archive/recipe_search.py --report                 # summary table to stdout
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import dpfit.train as dptrain  # noqa: E402
from dpfit.data.tasks import HELD_OUT, TASKS, load_task, write_csv  # noqa: E402

HERE = (
    Path(__file__).resolve().parents[1]
)  # benchmarks/ (this script is archived in benchmarks/archive/)
CACHE = HERE / ".cache"
LOG = HERE / "results" / "archive" / "recipe_search.jsonl"
logger = logging.getLogger("recipe_search")


class MeanPoolClassifier(torch.nn.Module):
    """Encoder + mean of token states over the mask + linear head (search-only variant)."""

    def __init__(self, encoder, num_labels: int, zero_init: bool):
        super().__init__()
        self.bert = encoder
        self.classifier = torch.nn.Linear(encoder.config.hidden_size, num_labels)
        if zero_init:
            torch.nn.init.zeros_(self.classifier.weight)
            torch.nn.init.zeros_(self.classifier.bias)
        self.config = encoder.config

    def forward(self, input_ids, attention_mask, labels=None, **kw):
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask, **kw).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(h.dtype)
        logits = self.classifier((h * mask).sum(1) / mask.sum(1).clamp(min=1))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return dataclasses.make_dataclass("Out", ["loss", "logits"])(loss, logits)


def _loader(pooling: str, zero_init: bool):
    original = dptrain.load_classifier

    def load(name, label_names, seed=None):
        loaded = original(name, label_names, seed=seed)
        if pooling == "pooler" and not zero_init:
            return loaded
        model = loaded.model
        if pooling == "mean":
            torch.manual_seed(seed or 0)
            model = MeanPoolClassifier(model.bert, len(label_names), zero_init)
        elif zero_init:
            torch.nn.init.zeros_(model.classifier.weight)
            torch.nn.init.zeros_(model.classifier.bias)
        return dataclasses.replace(loaded, model=model, head_names=("classifier",))

    return load


def task_csvs(name: str, seed: int, test_n: int) -> tuple[Path, Path, int, int]:
    folder = CACHE / "tasks" / f"{name}_s{seed}_t{test_n}"
    task = load_task(name, seed)
    if not (folder / "test.csv").exists():
        write_csv(task.train, folder / "train.csv")
        write_csv(task.test.subsample(test_n, seed=seed), folder / "test.csv")
    return folder / "train.csv", folder / "test.csv", len(task.train), task.num_labels


# name -> list of (label, overrides). Shared fields come from BASE. B_FRAC: logical batch as a
# fraction of n (private) - the rule candidate; an int batch_size overrides.
BASE = dict(epochs=3, max_length=32, physical_batch_size=64, clipping="automatic")
GRIDS: dict[str, list[dict]] = {
    "np-ref": [dict(non_private=True, batch_size=32, lr=5e-3)],
    "np-mean": [dict(non_private=True, batch_size=32, lr=5e-3, pooling="mean")],
    "np-lr": [dict(non_private=True, batch_size=32, lr=1e-3)],
    "dp-ref": [dict(epsilon=8.0, b_frac=0.1, lr=1e-2)],
    "dp-mean": [dict(epsilon=8.0, b_frac=0.1, lr=1e-2, pooling="mean", zero_init=True)],
    "dp-clip": [dict(epsilon=8.0, b_frac=0.1, lr=1e-2, clipping="flat", max_grad_norm=1.0)],
    "dp-batch": [dict(epsilon=8.0, b_frac=0.25, lr=1e-2)],
    "dp-lr": [dict(epsilon=8.0, b_frac=0.1, lr=3e-3), dict(epsilon=8.0, b_frac=0.1, lr=3e-2)],
    "dp-eps": [
        dict(epsilon=1.0, b_frac=0.1, lr=1e-2),
        dict(epsilon=3.0, b_frac=0.1, lr=1e-2),
    ],
    "dp-epochs": [dict(epsilon=8.0, b_frac=0.1, lr=1e-2, epochs=6)],
}


def run_key(task: str, n: int, seed: int, spec: dict) -> str:
    return json.dumps({"task": task, "n": n, "seed": seed, **spec}, sort_keys=True)


def done_keys(log: Path) -> set[str]:
    if not log.exists():
        return set()
    return {json.loads(line)["key"] for line in log.read_text().splitlines() if line.strip()}


def run_one(task: str, n: int, seed: int, test_n: int, spec: dict) -> dict:
    train_csv, test_csv, n_full, classes = task_csvs(task, seed, test_n)
    n_used = min(n, n_full)
    fields = {**BASE, **{k: v for k, v in spec.items() if k in TRAIN_FIELDS}}
    if "b_frac" in spec:
        fields["batch_size"] = max(1, round(spec["b_frac"] * n_used))
    fields["physical_batch_size"] = min(fields["physical_batch_size"], fields["batch_size"])
    cfg = dptrain.TrainConfig(
        data=str(train_csv),
        eval_data=str(test_csv),
        max_train_examples=n,
        seed=seed,
        delta=None,
        **fields,
    )
    dptrain.load_classifier = _loader(spec.get("pooling", "pooler"), spec.get("zero_init", False))
    t = time.perf_counter()
    res = dptrain.train(cfg)
    m = res.metrics
    return {
        "task": task,
        "n": n_used,
        "classes": classes,
        "seed": seed,
        "spec": spec,
        "batch_size": fields["batch_size"],
        "accuracy": m["accuracy"],
        "epsilon": m["epsilon"],
        "noise_multiplier": m["noise_multiplier"],
        "steps": m["steps"],
        "final_loss": m["final_loss"],
        "train_s": m["train_time_s"],
        "wall_s": time.perf_counter() - t,
        "threads": torch.get_num_threads(),
    }


TRAIN_FIELDS = {f.name for f in dataclasses.fields(dptrain.TrainConfig)}


def report(log: Path) -> None:
    """Markdown table of every finished run, grouped by task."""
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    print("| task | n | setting | B | steps | sigma | test acc | wall (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["task"], r["key"])):
        spec = ", ".join(f"{k}={v}" for k, v in r["spec"].items())
        sigma = r.get("noise_multiplier")
        acc = "failed" if "error" in r else f"{100 * r['accuracy']:.1f}"
        print(
            f"| {r['task']} | {r['n']} | {spec} | {r['batch_size']} | {r['steps']} | "
            f"{'-' if sigma is None else f'{sigma:.2f}'} | {acc} | {r['wall_s']:.0f} |"
        )


def sigma_table() -> None:
    """Noise multiplier and per-step noise on the mean gradient (sigma/B) for candidate rules."""
    from dpfit.accounting import noise_multiplier_for

    print("| n | rule | B | epochs | steps | eps | sigma | sigma/B |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (1000, 3000, 10000):
        delta = min(1e-5, n**-1.1)
        rules = {
            "B=n/10, 3 epochs": (n // 10, 3),
            "B=10 sqrt(n) <= n/4, >= 50 steps": (int(min(10 * math.sqrt(n), n / 4)), None),
        }
        for name, (b, epochs) in rules.items():
            per_epoch = max(1, round(n / b))
            if epochs is None:
                epochs = max(3, min(20, math.ceil(50 / per_epoch)))
            steps = epochs * per_epoch
            for eps in (1.0, 3.0, 8.0):
                s = noise_multiplier_for(eps, delta, b / n, steps)
                print(
                    f"| {n} | {name} | {b} | {epochs} | {steps} | {eps:g} | {s:.2f} | {s / b:.4f} |"
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--grid", nargs="+", default=["np-ref"], choices=sorted(GRIDS))
    # the held-out tasks only check the recipe: never tune on them
    tuning = [t for t in TASKS if t not in HELD_OUT]
    p.add_argument("--tasks", nargs="+", default=tuning, choices=tuning)
    p.add_argument("--n", type=int, default=1000, help="training examples per run")
    p.add_argument("--test-n", type=int, default=800)
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--log", default=str(LOG))
    p.add_argument("--report", action="store_true")
    p.add_argument("--sigma-table", action="store_true")
    args = p.parse_args()
    log = Path(args.log)
    if args.sigma_table:
        sigma_table()
        return
    if args.report:
        report(log)
        return
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logger.setLevel(logging.INFO)
    log.parent.mkdir(parents=True, exist_ok=True)
    for grid in args.grid:
        for spec in GRIDS[grid]:
            for task in args.tasks:
                for seed in args.seeds:
                    key = run_key(task, args.n, seed, spec)
                    if key in done_keys(log):
                        continue
                    logger.info("run %s", key)
                    try:
                        row = run_one(task, args.n, seed, args.test_n, spec)
                    except Exception as e:  # keep going; record the failure
                        logger.exception("failed: %s", key)
                        row = {"task": task, "seed": seed, "spec": spec, "error": repr(e)}
                        row.update(accuracy=math.nan, batch_size=0, steps=0, n=args.n)
                        row.update(epsilon=math.nan, noise_multiplier=None, wall_s=0.0)
                    row["key"] = key
                    row["grid"] = grid
                    with open(log, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    logger.info("acc %.3f in %.0fs", row["accuracy"], row["wall_s"])


if __name__ == "__main__":
    main()

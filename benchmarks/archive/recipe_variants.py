"""One dpfit row of the utility suite with some recipe fields overridden, at full size.

Why: to test a candidate change of the default rule (a batch or learning-rate rule) on the
suite's own tasks and splits before adopting it. Each run appends one record to
results/archive/recipe_variants.jsonl; compare with the default row of the same task and seed in
results/utility_runs.jsonl.

    PYTHONPATH=src python benchmarks/archive/recipe_variants.py text-source 0 B250-eps8 \
        '{"epsilon": 8.0, "batch_size": 250}'

When a variant becomes the default rule, its runs are the suite's runs of that row: the same
configuration on the same split and seed. `--adopt TAG ROW` copies them into the suite's log
under the row's key, after checking that the current rule resolves every overridden field to
the variant's value and leaves the rest of the recorded recipe as it was (a run can only be
adopted if running the row now would run it again), and moves the row's runs under the old rule (this seed's and any other's) to
results/utility_runs_superseded.jsonl:

    PYTHONPATH=src python benchmarks/archive/recipe_variants.py --adopt np-lr1e-3 np-bias
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]  # archived in benchmarks/archive/
sys.path.insert(0, str(BENCHMARKS))  # the harness and the scripts it borrows from

import utility as U  # noqa: E402

RESULTS = BENCHMARKS / "results"
OUT = RESULTS / "archive" / "recipe_variants.jsonl"
SUITE_LOG = RESULTS / "utility_runs.jsonl"
# runs whose recipe the default rule no longer gives (kept, out of the suite's table)
SUPERSEDED = RESULTS / "utility_runs_superseded.jsonl"
# recipe fields that do not depend on the model's size (the physical batch does)
MODEL_FREE = ("batch_size", "epochs", "lr", "max_grad_norm", "clipping", "max_length", "optimizer",
              "head_epochs", "head_lr")  # fmt: skip


def main(task: str, seed: int, tag: str, overrides: dict) -> None:
    row = U.Row("variant", tag, "dpfit", overrides)
    start = time.time()
    for r in U.run_row(row, task, seed, U.Scale(None, None)):
        r.update(task=task, seed=seed, tag=tag, over=overrides, wall=time.time() - start)
        with OUT.open("a") as f:
            f.write(json.dumps(r, default=str) + "\n")
        print({k: r.get(k) for k in ("task", "tag", "accuracy", "head_first_accuracy", "steps")})


def current_recipe(record: dict, row: U.Row):
    from dpfit.recipe import resolve_recipe

    train = {**row.train, **{k: v for k, v in record.get("over", {}).items() if k in ("mode",)}}
    private = not train.get("non_private", False)
    task = U.load_task(record["task"], record["seed"])
    return resolve_recipe(
        record["n_train"],
        task.num_labels,
        train.get("epsilon") if private else None,
        None,
        model_params=20_000_000,  # only the physical batch depends on it; not compared
        mode=train.get("mode", "bias"),
        private=private,
        head_first=train.get("head_first"),
    )


def stale(line: str, row: U.Row) -> bool:
    """A full-size run of `row` whose recorded recipe the current rule no longer gives."""
    r = json.loads(line)
    if r.get("row") != row.name or r.get("scale") != U.Scale(None, None).tag() or "recipe" not in r:
        return False
    now = current_recipe(r, row).as_dict()
    return any(r["recipe"].get(k) != now[k] for k in MODEL_FREE)


def adopt(tag: str, row_key: str) -> None:
    row = U.ROW_BY_KEY[row_key]
    records = [json.loads(x) for x in OUT.read_text().splitlines() if x.strip()]
    chosen = [r for r in records if r.get("tag") == tag and "accuracy" in r]
    if not chosen:
        raise SystemExit(f"no finished run tagged {tag!r} in {OUT}")
    for r in chosen:
        extra = {k: v for k, v in r["over"].items() if k not in row.train or row.train[k] != v}
        now = current_recipe(r, row).as_dict()
        fields = dict(r["recipe"], **{k: v for k, v in extra.items() if k in now})
        wrong = {k: (fields[k], now[k]) for k in MODEL_FREE if fields.get(k) != now[k]}
        unknown = [k for k in extra if k not in now]
        if wrong or unknown:
            raise SystemExit(
                f"{r['task']} seed {r['seed']}: the current rule would not run this variant "
                f"again (variant, rule now: {wrong}; not recipe fields: {unknown})"
            )
    scale = U.Scale(None, None)
    keys = {U.run_key(row, r["task"], r["seed"], scale) for r in chosen}
    kept, moved = [], []
    for line in SUITE_LOG.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if r.get("adopted_from") == f"recipe_variants.jsonl {tag}" and r.get("key") in keys:
                continue  # adopted before: replaced by the same run below, not superseded
            (moved if r.get("key") in keys or stale(line, row) else kept).append(line)
    with SUPERSEDED.open("a") as f:
        f.writelines(line + "\n" for line in moved)
    for r in chosen:
        rec = {k: v for k, v in r.items() if k not in ("tag", "over", "wall", "row")}
        key = U.run_key(row, r["task"], r["seed"], scale)
        kept.append(json.dumps({"key": key, "task": r["task"], "seed": r["seed"],
                                "scale": scale.tag(), "wall_s": r["wall"], **rec,
                                "row": row.name, "adopted_from": f"recipe_variants.jsonl {tag}"},
                               default=str))  # fmt: skip
    SUITE_LOG.write_text("".join(line + "\n" for line in kept))
    print(
        f"adopted {len(chosen)} run(s) of {tag} as {row.name}; moved {len(moved)} to {SUPERSEDED.name}"
    )


if __name__ == "__main__":
    if sys.argv[1] == "--adopt":
        adopt(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))

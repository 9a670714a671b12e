"""One dpfit row of the utility suite with some recipe fields overridden, at full size.

Why: to test a candidate change of the default rule (a batch or learning-rate rule) on the
suite's own tasks and splits before adopting it. Each run appends one record to
results/recipe_variants.jsonl; compare with the default row of the same task and seed in
results/utility_runs.jsonl.

    PYTHONPATH=src python benchmarks/recipe_variants.py text-source 0 B250-eps8 \
        '{"epsilon": 8.0, "batch_size": 250}'
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import utility as U

OUT = Path(__file__).resolve().parent / "results" / "recipe_variants.jsonl"


def main(task: str, seed: int, tag: str, overrides: dict) -> None:
    row = U.Row("variant", tag, "dpfit", overrides)
    start = time.time()
    for r in U.run_row(row, task, seed, U.Scale(None, None)):
        r.update(task=task, seed=seed, tag=tag, over=overrides, wall=time.time() - start)
        with OUT.open("a") as f:
            f.write(json.dumps(r, default=str) + "\n")
        print({k: r.get(k) for k in ("task", "tag", "accuracy", "head_first_accuracy", "steps")})


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]))

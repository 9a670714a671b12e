"""Probe (issue 44, one-off): can the SERVER pick C from public data alone, where every
client-side vote picks the largest clip short of collapse?

The clients' vote (DP-LAC's and lac-2s's) scores each client's OWN update on its own
examples: a single client's update carries its full signal there, while the released
average of m clients carries only what they agree on, so the vote overrates a large clip
(lac-2s picks C_0 = 1 at eps 2 and 8 alike). The server holds a public validation set and
knows z, m and T, so it can run the trial itself, free of privacy cost: pseudo-clients
cut from one half of the public set train as clients do, their clipped updates are averaged,
the noise a run will carry is added, and the other half scores the result.

Two trials per candidate C (the lac-2s grid, 0.1..10 x C_init = 1):
- ``one step``: start + mean of clipped pseudo-updates + N(0, (z C sqrt(T) / m)^2), the
  loss averaged over several noise draws (lac-2s's objective with a population signal);
- ``simulated run``: T rounds of DP-FedAvg on the pseudo-clients (k of them sampled a
  round) with the real noise std z C / m on the average, scored at the end.

Reads only the public validation split (no client data, no test split), at the protocol's
scale (MiniLM lora-top, sgd lr 0.5, 2 local epochs, z of the fixed rule at eps 2 and 8,
m = 100, T = 20), and prints each trial's loss and accuracy per candidate.

    python benchmarks/archive/server_trial_probe.py --cache-file /tmp/misspec_cache.pt
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

OUT = ROOT / "benchmarks" / "results" / "archive" / "server_trial_probe.json"
FACTORS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
Z = {2.0: 1.4841761034978371, 8.0: 0.7339882553805258}  # the fixed rule's, in the protocol
ROUNDS, M = 20, 100.0
PER_CLIENT = 10
DRAWS = 8  # noise draws averaged by the one-step trial


def mean_clipped(updates, c):
    from dpfit.federated.clipping import clip_update

    clipped = [clip_update(u, c)[0] for u in updates]
    return [np.mean([u[i] for u in clipped], axis=0) for i in range(len(updates[0]))]


def main() -> None:
    from federated_lac import setup

    p = argparse.ArgumentParser()
    p.add_argument("--cache-file", default=None)
    p.add_argument("--per-round", type=int, default=10, help="pseudo-clients a simulated round")
    a = p.parse_args()
    args = argparse.Namespace(
        model="", max_length=48, lr=0.5, local_optimizer="sgd", clients=1000,
        val_examples=600, vote_memo=None, cache_file=a.cache_file,
    )  # fmt: skip
    t0 = time.process_time()
    task, engine, val, _test, _ = setup(args)
    eng = engine.engine
    start = [np.asarray(x) for x in eng.lm.get_arrays()]
    texts, labels = val
    order = np.random.default_rng(0).permutation(len(texts))
    half = len(texts) // 2
    fit_idx, score_idx = order[:half], order[half:]
    from dpfit.data.bundled import TextExample

    examples = [TextExample(texts[i], labels[i]) for i in fit_idx]
    pseudo = [examples[i : i + PER_CLIENT] for i in range(0, len(examples), PER_CLIENT)]
    score = eng.evaluate_fn([texts[i] for i in score_idx], [labels[i] for i in score_idx])
    eng.cache.fill([e.text for e in examples])

    def updates_at(params, which, rnd):
        rngs = [np.random.default_rng([task.seed, 10_000 + w, rnd]) for w in which]
        return eng.train(params, [pseudo[w] for w in which], rngs)

    first = updates_at(start, range(len(pseudo)), 0)
    norms = [math.sqrt(sum(float(np.sum(np.square(x))) for x in u)) for u in first]
    results = []
    for eps, z in Z.items():
        for c in FACTORS:
            avg = mean_clipped(first, c)
            rng = np.random.default_rng([1, int(eps), int(c * 100)])
            std = z * c * math.sqrt(ROUNDS) / M
            one = [
                score(
                    [
                        s + g + rng.normal(0.0, std, s.shape).astype(s.dtype)
                        for s, g in zip(start, avg, strict=True)
                    ]
                )  # fmt: skip
                for _ in range(DRAWS)
            ]
            params = [s.copy() for s in start]
            sim_rng = np.random.default_rng([2, int(eps), int(c * 100)])
            for rnd in range(1, ROUNDS + 1):
                which = sim_rng.choice(len(pseudo), size=a.per_round, replace=False)
                g = mean_clipped(updates_at(params, which, rnd), c)
                params = [
                    (s + x + sim_rng.normal(0.0, z * c / M, s.shape)).astype(s.dtype)
                    for s, x in zip(params, g, strict=True)
                ]
            run = score(params)
            row = {
                "eps": eps, "clip": c,
                "one_step_loss": float(np.mean([x[0] for x in one])),
                "one_step_accuracy": float(np.mean([x[1] for x in one])),
                "run_loss": run[0], "run_accuracy": run[1],
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            results.append(row)
    summary = {}
    for eps in Z:
        rows = [r for r in results if r["eps"] == eps]
        summary[str(eps)] = {
            k: min(rows, key=lambda r, k=k: r[k] if "loss" in k else -r[k])["clip"]
            for k in ("one_step_loss", "one_step_accuracy", "run_loss", "run_accuracy")
        }
    out = {
        "factors": FACTORS, "pseudo_clients": len(pseudo), "scored_examples": len(score_idx),
        "median_pseudo_update_norm": float(np.median(norms)), "rows": results,
        "best_clip": summary, "cpu_seconds": time.process_time() - t0,
    }  # fmt: skip
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

"""Probe (issue 44, one-off): does the clip vote pick a smaller C at eps 2 if each client
scores its trial on examples it did not train on?

The misspecification protocol found lac-2s's vote picks C_0 = 1 at eps 2 and at eps 8
(C* = 0.25 and 1): each client's trial is its OWN update, scored on the examples it was
trained on, so the benefit of a large clip (the update it overfits) swamps the noise's cost.
This scores the vote's objective four ways on the protocol's clients (MiniLM lora-top, N =
1000, 10 examples each, sgd lr 0.5, 2 local epochs, C_init = 1, candidates 0.1..10):

- same data (the shipped objective) or held out (train on the first 5 examples, score the
  trial on the other 5);
- one round's noise (z C / m, the paper's) or the run's (z C sqrt(T) / m, lac-2s's).

It reads only the clients' data (no validation or test split) and prints, per variant and
epsilon, the mean trial loss per candidate and the (noiseless) vote histogram.

    python benchmarks/archive/vote_heldout_probe.py --cache-file /tmp/misspec_cache.pt
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

OUT = ROOT / "benchmarks" / "results" / "archive" / "vote_heldout_probe.json"
FACTORS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
# lac-2s's combined multipliers in the protocol's records (eps 2, eps 8), its update share 0.9
COMBINED = {2.0: 1.4891295604540364, 8.0: 0.7364395632019278}
ROUNDS, M = 20, 100.0


def main() -> None:
    import torch
    from federated_lac import setup

    from dpfit.federated.clipping import clip_update

    p = argparse.ArgumentParser()
    p.add_argument("--cache-file", default=None)
    p.add_argument("--clients", type=int, default=1000)
    a = p.parse_args()
    args = argparse.Namespace(
        model="", max_length=48, lr=0.5, local_optimizer="sgd", clients=a.clients,
        val_examples=600, vote_memo=None, cache_file=a.cache_file,
    )  # fmt: skip
    t0 = time.process_time()
    task, engine, *_ = setup(args)
    eng = engine.engine
    start = eng.lm.get_arrays()
    pids = list(range(a.clients))
    full = eng._data(pids)
    fit = [d[:5] for d in full]
    held = [d[5:] for d in full]
    rng_of = lambda: [np.random.default_rng([task.seed, p, 0]) for p in pids]  # noqa: E731
    updates = {
        "same data": eng.train(start, full, rng_of()),
        "held out": eng.train(start, fit, rng_of()),
    }
    scored_on = {"same data": full, "held out": held}
    results = []
    for variant, ups in updates.items():
        norms = [math.sqrt(sum(float(np.sum(np.square(x))) for x in u)) for u in ups]
        for eps, z in COMBINED.items():
            zu = z / math.sqrt(0.9)
            for noise, mult in (("round", zu), ("run", zu * math.sqrt(ROUNDS))):
                cols = []
                for c in FACTORS:
                    rngs = rng_of()
                    trials = []
                    for u, r in zip(ups, rngs, strict=True):
                        clipped, _ = clip_update(u, c)
                        std = mult * c / M
                        trials.append([np.asarray(s) + cu + r.normal(0.0, std, cu.shape).astype(cu.dtype)
                                       for s, cu in zip(start, clipped, strict=True)])  # fmt: skip
                    stacked = [torch.as_tensor(np.stack([t[i] for t in trials]), dtype=eng.dtype)
                               for i in range(len(start))]  # fmt: skip
                    cols.append(eng.mean_losses(stacked, scored_on[variant]))
                losses = np.asarray(cols).T
                votes = np.bincount(losses.argmin(1), minlength=len(FACTORS))
                row = {
                    "variant": variant, "eps": eps, "noise": noise,
                    "mean_loss": losses.mean(0).round(4).tolist(),
                    "votes": votes.tolist(), "mode": FACTORS[int(votes.argmax())],
                    "median_update_norm": float(np.median(norms)),
                }  # fmt: skip
                print(json.dumps(row), flush=True)
                results.append(row)
    OUT.write_text(json.dumps({"factors": FACTORS, "rows": results,
                               "cpu_seconds": time.process_time() - t0}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()

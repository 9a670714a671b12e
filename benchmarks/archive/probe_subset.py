"""Frozen-feature probes (pooler / CLS / mean) on the same training and test subsets that
benchmarks/archive/recipe_search.py trains and scores on (seeded like LabeledTexts.subsample).

    python benchmarks/archive/probe_subset.py rotten-tomatoes convention-party
"""

from __future__ import annotations

import json
import random
import sys
import warnings
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegressionCV
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from dpfit.data.tasks import load_task

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # archived: baselines is one up
warnings.filterwarnings("ignore", category=FutureWarning)


def main(names: list[str], n: int = 1000, test_n: int = 800, seed: int = 0) -> None:
    import baselines

    for name in names:
        t = load_task(name, seed)
        ftr = baselines.frozen_features(t.train.texts, baselines.PROBE_MAX_LENGTH)
        fte = baselines.frozen_features(t.test.texts, baselines.PROBE_MAX_LENGTH)
        idx = sorted(random.Random(seed).sample(range(len(t.train)), n))
        tidx = sorted(random.Random(seed).sample(range(len(t.test)), test_n))
        y, yt = np.array(t.train.labels)[idx], np.array(t.test.labels)[tidx]
        out = {"task": name, "n": n, "majority_of_test": float(max(np.bincount(yt)) / len(yt))}
        for p in baselines.POOLINGS:
            clf = make_pipeline(
                StandardScaler(),
                LogisticRegressionCV(Cs=np.logspace(-3, 2, 6), cv=5, max_iter=2000),
            )
            clf.fit(ftr[p][idx], y)
            out[p] = float((clf.predict(fte[p][tidx]) == yt).mean())
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

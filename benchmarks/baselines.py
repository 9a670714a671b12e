"""Baselines a practitioner tries before fine-tuning: TF-IDF + LR and frozen-feature probes.

Both are non-private and fit on the training split only (the regularisation strength C is
picked by 5-fold cross-validation inside the training split); accuracy is on the test split.

Frozen features come from the bundled all-MiniLM-L6-v2 with three poolings: the pooler
output (what a BertForSequenceClassification head reads), the [CLS] hidden state, and the
mean of the token states over the attention mask (how the sentence-transformers model was
trained). Features are cached under benchmarks/.cache (gitignored) keyed by the texts, model
and max length, so reruns cost nothing.

    python benchmarks/baselines.py                     # all tasks, seed 0
    python benchmarks/baselines.py --tasks convention-party --seeds 0 1 2
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning, module="sklearn")

from dpfit.data.tasks import TASKS, TaskSplits, load_task  # noqa: E402

CACHE = Path(__file__).resolve().parent / ".cache"
POOLINGS = ("pooler", "cls", "mean")
PROBE_MAX_LENGTH = 64  # the frozen features see what fine-tuning sees (texts are short)
CS = np.logspace(-3, 2, 6)
logger = logging.getLogger("baselines")


def tfidf_lr(task: TaskSplits, seed: int = 0) -> dict:
    """TF-IDF of 1-2 grams + logistic regression, C by 5-fold CV on the training split."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegressionCV

    t = time.perf_counter()
    vec = TfidfVectorizer(ngram_range=(1, 2), min_df=2, sublinear_tf=True)
    x_train = vec.fit_transform(task.train.texts)
    x_test = vec.transform(task.test.texts)
    clf = LogisticRegressionCV(Cs=CS * 10, cv=5, max_iter=2000, random_state=seed)
    clf.fit(x_train, np.array(task.train.labels))
    acc = float((clf.predict(x_test) == np.array(task.test.labels)).mean())
    return {"accuracy": acc, "C": float(clf.C_[0]), "wall_s": time.perf_counter() - t}


HASH_FEATURES = 2**14  # fixed before any run: the map may not depend on the private texts


def hashed_ngrams(texts):
    """1-2 gram counts hashed into HASH_FEATURES columns, log(1 + tf), each row l2-normalised.

    Unlike TF-IDF this reads nothing from the corpus (no vocabulary, no IDF), so it is a
    feature map a DP model may use without spending budget on it."""
    from sklearn.feature_extraction.text import HashingVectorizer
    from sklearn.preprocessing import normalize

    vec = HashingVectorizer(
        ngram_range=(1, 2), n_features=HASH_FEATURES, alternate_sign=False, norm=None
    )
    x = vec.transform(texts).astype(np.float32)
    x.data = np.log1p(x.data)
    return normalize(x)


def dp_hashed_lr(
    task: TaskSplits, epsilon: float, seed: int = 0, epochs: int | None = None
) -> dict:
    """The private counterpart of TF-IDF + LR: logistic regression on `hashed_ngrams`, trained
    with dpfit's engine under (epsilon, default delta) with the recipe dpfit gives its own
    private linear head (batch, steps, automatic clipping R=1, AdamW at HEAD_FIRST_LR, zero
    init). Nothing is tuned on the task. Noise and sampling come from OS entropy, as in the
    product, so `seed` (the split's) fixes nothing here. `epochs` overrides the recipe's (a
    linear model is cheap, so a practitioner may well give it more passes)."""
    import torch

    import dpfit
    from dpfit.accounting import noise_multiplier_for
    from dpfit.recipe import HEAD_FIRST_LR, default_delta, resolve_recipe

    del seed
    t = time.perf_counter()
    x_train, x_test = hashed_ngrams(task.train.texts), hashed_ngrams(task.test.texts)
    y_train = np.array(task.train.labels)
    n, classes = len(y_train), task.num_labels
    head = torch.nn.Linear(HASH_FEATURES, classes)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    recipe = resolve_recipe(n, classes, epsilon, None, head.weight.numel(), head_first=False)
    delta = default_delta(n)
    epochs = epochs or recipe.epochs
    steps = epochs * max(1, round(n / recipe.batch_size))
    sigma = noise_multiplier_for(epsilon, delta, recipe.batch_size / n, steps)
    engine = dpfit.PrivacyEngine(
        head,
        expected_batch_size=recipe.batch_size,
        sample_size=n,
        noise_multiplier=sigma,
        target_delta=delta,
        max_grad_norm=recipe.max_grad_norm,
        clipping=recipe.clipping,
        loss_reduction="mean",
    )
    optimizer = torch.optim.AdamW(engine.parameters(), lr=HEAD_FIRST_LR, weight_decay=0.0)

    def collate(idx: list[int]) -> dict:
        return {
            "x": torch.from_numpy(x_train[idx].toarray()),
            "y": torch.from_numpy(y_train[idx]).long(),
        }

    loader = engine.data_loader(list(range(n)), collate, physical_batch_size=n, optimizer=optimizer)
    try:
        while engine.steps_taken < steps:
            for batch in loader:
                loss = torch.nn.functional.cross_entropy(head(batch["x"]), batch["y"])
                loss.backward()
                if engine.step(optimizer) and engine.steps_taken >= steps:
                    break
        spent = engine.epsilon()
    finally:
        engine.detach()
    with torch.no_grad():
        logits = torch.from_numpy(x_test @ head.weight.numpy().T) + head.bias
    acc = float((logits.argmax(1).numpy() == np.array(task.test.labels)).mean())
    return {
        "accuracy": acc,
        "epsilon": spent,
        "delta": delta,
        "noise_multiplier": sigma,
        "steps": steps,
        "epochs": epochs,
        "batch_size": recipe.batch_size,
        "lr": HEAD_FIRST_LR,
        "clipping": recipe.clipping,
        "wall_s": time.perf_counter() - t,
    }


def _key(texts, model_path: str, max_length: int) -> str:
    h = hashlib.sha256(f"{model_path}|{max_length}".encode())
    for t in texts:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def frozen_features(
    texts, max_length: int = 128, batch_size: int = 64, model_path: str | None = None
) -> dict[str, np.ndarray]:
    """{pooling: (n, hidden) features} of the frozen model; cached on disk."""
    import torch
    from transformers import AutoTokenizer, BertModel

    from dpfit.data.bundled import minilm_path

    model_path = str(model_path or minilm_path())
    path = CACHE / "features" / f"{_key(texts, model_path, max_length)}.npz"
    if path.exists():
        with np.load(path) as f:
            return {k: f[k] for k in POOLINGS}
    tok = AutoTokenizer.from_pretrained(model_path)
    model = BertModel.from_pretrained(model_path).eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = {k: np.zeros((len(texts), model.config.hidden_size), np.float32) for k in POOLINGS}
    with torch.no_grad():
        for s in range(0, len(order), batch_size):
            idx = order[s : s + batch_size]
            enc = tok(
                [texts[i] for i in idx],
                truncation=True,
                max_length=max_length,
                padding=True,
                return_tensors="pt",
            )
            o = model(**enc)
            mask = enc["attention_mask"].unsqueeze(-1).float()
            mean = (o.last_hidden_state * mask).sum(1) / mask.sum(1)
            out["pooler"][idx] = o.pooler_output.numpy()
            out["cls"][idx] = o.last_hidden_state[:, 0].numpy()
            out["mean"][idx] = mean.numpy()
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **out)
    return out


def features_of(texts, full_texts, max_length: int) -> dict[str, np.ndarray]:
    """Features of `texts` (a subset of `full_texts`) from the cache of the full list."""
    full = frozen_features(full_texts, max_length)
    where = {t: i for i, t in enumerate(full_texts)}
    idx = np.array([where[t] for t in texts])
    return {k: v[idx] for k, v in full.items()}


def probe(
    task: TaskSplits, max_length: int = PROBE_MAX_LENGTH, seed: int = 0, full: TaskSplits = None
) -> dict[str, dict]:
    """Standardised frozen features + logistic regression (C by CV), one row per pooling.

    `full`: the unsubsampled task, whose cached features are reused for a subset.
    """
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    full = full or task
    t = time.perf_counter()
    f_train = features_of(task.train.texts, full.train.texts, max_length)
    f_test = features_of(task.test.texts, full.test.texts, max_length)
    feat_s = time.perf_counter() - t
    y_train, y_test = np.array(task.train.labels), np.array(task.test.labels)
    rows = {}
    for pooling in POOLINGS:
        t = time.perf_counter()
        clf = make_pipeline(
            StandardScaler(),
            LogisticRegressionCV(Cs=CS, cv=5, max_iter=2000, random_state=seed),
        )
        clf.fit(f_train[pooling], y_train)
        acc = float((clf.predict(f_test[pooling]) == y_test).mean())
        rows[pooling] = {
            "accuracy": acc,
            "C": float(clf[-1].C_[0]),
            "wall_s": time.perf_counter() - t,
            "feature_s": feat_s,
        }
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=list(TASKS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--max-length", type=int, default=PROBE_MAX_LENGTH)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "baselines.json"))
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    results = []
    for name in args.tasks:
        for seed in args.seeds:
            task = load_task(name, seed)
            row = {
                "task": name,
                "seed": seed,
                "n_train": len(task.train),
                "n_test": len(task.test),
                "classes": task.num_labels,
                "majority": task.majority_rate(),
                "tfidf_lr": tfidf_lr(task, seed),
                "probe": probe(task, args.max_length, seed),
            }
            print(json.dumps(row), flush=True)
            results.append(row)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Federated clip rules at equal privacy: fixed, quantile, automatic, dynamic, DP-LAC, DP-CLAC.

Dirichlet(alpha) label-skewed clients from the bundled Rotten Tomatoes data, same seeds and
rounds for every method, noise calibrated so all meet the same client-level epsilon. Runs
in-process (``LocalGrid``; the same ClientApp and Strategy as the Flower engines). Tuning cost:
each baseline is also run over a small grid (best on validation, reported on test) and the
number of training runs that takes is reported next to the untuned default.

Partitions: ``dirichlet`` is the app's flwr-datasets DirichletPartitioner (per-class shares
across clients; unequal sizes; at alpha=0.5 it fails for 500+ clients, as its minimum partition
size of 2 is not met in 10 draws). ``dirichlet-client`` (default here) gives every client the same
number of examples, floor(train / N), and its own label mix p_i ~ Dir(alpha * K * prior)
(Hsu et al. 2019), drawn without replacement from the training split: the many-small-clients
regime that client-level DP needs.

Head mode (the default) trains the classifier on frozen MiniLM pooled features that the
benchmark encodes once (``--feature-cache``) and z-scores with statistics of the server's
public validation split (``--no-standardize`` for the raw features, on which FedAvg does not
leave the majority class in 30 rounds even without noise).

    python benchmarks/federated.py                 # 6 rules, 48 runs per seed
    python benchmarks/federated.py --methods fixed adaptive-quantile lac clac --seeds 0 1 2
                                                    # the recorded run (81 runs)
    python benchmarks/federated.py --noise-multiplier 0 --no-tune --epsilons 8 --seeds 0 \
        --out /tmp/nonprivate                       # non-private sanity check

    python benchmarks/federated.py --from-json benchmarks/results/federated.json
                                                    # re-render md/png from recorded runs

Prints a markdown table; writes benchmarks/results/federated.{json,png,md}. Every figure in
federated.md is computed here from the runs recorded in federated.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from dpfit.federated import app as fed_app
from dpfit.federated import client as fed_client
from dpfit.federated.app import make_evaluate_fn, run_local
from dpfit.federated.client import TaskConfig
from dpfit.federated.strategy import ServerConfig

METHODS = ("fixed", "adaptive-quantile", "automatic", "dynamic", "lac", "clac")
# Small tuning grids: what a practitioner would try; LAC and CLAC add no hyperparameter.
GRIDS: dict[str, list[dict]] = {
    "fixed": [{"initial_clip": c} for c in (0.1, 0.3, 1.0, 3.0)],
    "adaptive-quantile": [{"target_quantile": g} for g in (0.3, 0.5, 0.7)],
    "automatic": [{"initial_clip": r} for r in (0.1, 0.3, 1.0, 3.0)],
    "dynamic": [{"clip_decay": r, "noise_decay": r} for r in (0.3, 0.5, 0.8)],
    "lac": [{}],
    "clac": [{}],
}
# The untuned setting of each method inside its grid: C=1, median target (Andrew et al.).
DEFAULTS: dict[str, dict] = {
    "fixed": {"initial_clip": 1.0},
    "adaptive-quantile": {"target_quantile": 0.5},
    "automatic": {"initial_clip": 1.0},
    "dynamic": {"clip_decay": 0.5, "noise_decay": 0.5},
    "lac": {},
    "clac": {},
}


_APP_PARTITIONS = fed_app.partitions


@functools.lru_cache(maxsize=4)
def _partitions(
    num_clients: int, partition: str, alpha: float, seed: int
) -> tuple[tuple[int, ...], ...]:
    """``dirichlet-client``: equal-size clients, each with its own label mix ~ Dir(alpha K prior).

    Anything else goes to the app's own partitions (iid, dirichlet, movie).
    """
    if partition != "dirichlet-client":
        return _APP_PARTITIONS(num_clients, partition, alpha, seed)
    train = fed_app.splits(seed)[0]
    labels = np.array([e.label for e in train])
    classes = np.unique(labels)
    prior = np.array([(labels == c).mean() for c in classes])
    rng = np.random.default_rng([seed, 1105])
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in classes]
    size = len(train) // num_clients
    if size < 1:
        raise fed_app.PartitionError(f"{len(train)} training examples for {num_clients} clients")
    out = []
    for _ in range(num_clients):
        mix = rng.dirichlet(alpha * len(classes) * prior)
        want = rng.multinomial(size, mix)
        idx: list[int] = []
        for k, n in enumerate(want):
            take = min(int(n), len(pools[k]))
            idx += [int(pools[k].pop()) for _ in range(take)]
        for pool in sorted(pools, key=len, reverse=True):  # a class ran out: fill from others
            while len(idx) < size and pool:
                idx.append(int(pool.pop()))
        out.append(tuple(sorted(idx)))
    return tuple(out)


def _install_partitions() -> None:
    """Route the app's partition lookup through ``_partitions`` (this process only)."""
    fed_app.partitions = _partitions


# --------------------------------------------------------------------------------------------
# Frozen features for head mode, computed once for the whole corpus
# --------------------------------------------------------------------------------------------
# The ClientApp encodes each client's texts on first contact, in batches of <= 10 here; with
# 1000 clients and several worker processes that dominates a run. The benchmark encodes the
# corpus once (length-sorted batches, same encoder, same max_length), stores it on disk, and
# serves the ClientApp's feature lookup from it. Padding is masked, so the features match the
# per-client ones up to float rounding.

_TEXT_FEATURES: dict[str, torch.Tensor] = {}
_FEATURE_MEMO: dict[tuple[str, ...], torch.Tensor] = {}


def feature_cache_path(args: argparse.Namespace) -> Path:
    return Path(args.feature_cache) / f"minilm_pooled_len{args.max_length}.pt"


def build_feature_cache(args: argparse.Namespace) -> Path:
    from dpfit.data.bundled import rotten_tomatoes

    path = feature_cache_path(args)
    if path.exists():
        return path
    lm = fed_client.load_local_model("", "head", 4, 0)
    enc = fed_client._encoder(lm.model)
    texts = sorted({e.text for e in rotten_tomatoes()}, key=len)
    outs = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(texts), 128):
            batch = lm.tokenizer(
                texts[i : i + 128],
                truncation=True,
                max_length=args.max_length,
                padding=True,
                return_tensors="pt",
            )
            outs.append(enc(**batch)[1])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"texts": texts, "features": torch.cat(outs)}, tmp)
    tmp.replace(path)
    print(f"encoded {len(texts)} texts in {time.perf_counter() - t0:.0f}s -> {path}", flush=True)
    return path


def _install_features(path: Path | None, standardize: bool = False, seed: int = 0) -> None:
    """Serve head-mode features from ``path``; optionally z-scored with public statistics.

    ``standardize``: subtract the mean and divide by the std of the features of the server's
    validation split (public data, no privacy cost): a frozen affine layer in front of the
    head. The raw pooled features share a large common component, which makes the head
    ill-conditioned for a few local Adam steps per round (FedAvg barely moves off the
    majority class in 30 rounds even without noise).
    """
    if path is None or _TEXT_FEATURES:
        return
    data = torch.load(path)
    feats = data["features"]
    if standardize:
        index = {t: i for i, t in enumerate(data["texts"])}
        val = feats[[index[e.text] for e in fed_app.splits(seed)[1]]]
        feats = (feats - val.mean(0)) / (val.std(0) + 1e-6)
    _TEXT_FEATURES.update(zip(data["texts"], feats, strict=True))
    original = fed_client._Features.get.__func__

    def get(cls, lm, texts, max_length):
        key = tuple(texts)
        if key not in _FEATURE_MEMO:
            if lm.local_mode != "head" or not all(t in _TEXT_FEATURES for t in key):
                return original(cls, lm, texts, max_length)
            _FEATURE_MEMO[key] = torch.stack([_TEXT_FEATURES[t] for t in key])
        return _FEATURE_MEMO[key]

    fed_client._Features.get = classmethod(get)


def run_one(method: str, eps: float, seed: int, args: argparse.Namespace, **overrides) -> dict:
    _install_partitions()
    if args.local_mode == "head" and args.feature_cache:
        _install_features(feature_cache_path(args), args.standardize, args.data_seed)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    task = TaskConfig(
        local_mode=args.local_mode,
        max_length=args.max_length,
        local_epochs=args.local_epochs,
        local_batch_size=args.local_batch_size,
        lr=args.lr,
        num_clients=args.clients,
        partition=args.partition,
        alpha=args.alpha,
        examples_per_client=args.examples_per_client,
        eval_examples=args.eval_examples,
        seed=args.data_seed,
    )
    cfg = ServerConfig(
        method=method,
        num_clients=args.clients,
        clients_per_round=args.clients_per_round,
        rounds=args.rounds,
        target_epsilon=eps,
        delta=args.delta,
        noise_multiplier=args.noise_multiplier,
        initial_clip=1.0,
        # a benchmark compares methods on the same draws: reproducible, so not private
        insecure_seed=seed,
    )
    cfg = replace(cfg, **overrides)
    t0 = time.perf_counter()
    server = run_local(cfg, task)
    test_loss, test_acc = make_evaluate_fn(task, "test")(server.params)
    return {
        "method": method,
        "epsilon_target": eps,
        "epsilon": server.accountant.epsilon(),
        "seed": seed,
        "insecure_seed": server.insecure,
        "overrides": overrides,
        "val_loss": server.history[-1].val_loss,
        "val_accuracy": server.history[-1].accuracy,
        "test_accuracy": test_acc,
        "test_loss": test_loss,
        "noise_multiplier": server.noise_multiplier,
        "update_multiplier": server.rule.update_multiplier,
        "rounds_run": len(server.history),
        "stop_reason": server.stop_reason,
        "vote_counts": server.vote_counts,
        "initial_clip": server.initial_clip,
        "final_clip": server.rule.clip_norm,
        "clips": [r.clip_norm for r in server.history],
        "val_accuracies": [r.accuracy for r in server.history],
        "seconds": time.perf_counter() - t0,
    }


def _job(spec: tuple[str, float, int, dict], args: argparse.Namespace) -> dict:
    method, eps, seed, overrides = spec
    return run_one(method, eps, seed, args, **overrides)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--clients", type=int, default=1000, help="population N")
    p.add_argument(
        "--clients-per-round", type=float, default=100, help="expected m (Poisson, q = m/N)"
    )
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument(
        "--partition",
        default="dirichlet-client",
        choices=("dirichlet-client", "dirichlet", "iid", "movie"),
    )
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument(
        "--noise-multiplier",
        type=float,
        default=None,
        help="fix z instead of calibrating to each epsilon; 0 = non-private sanity run",
    )
    p.add_argument("--local-mode", default="head", choices=("head", "bias", "lora"))
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--local-batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--examples-per-client", type=int, default=10, help="cap; 0 = all")
    p.add_argument("--eval-examples", type=int, default=300)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--no-tune", action="store_true", help="skip the tuning grids")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument(
        "--feature-cache",
        default="/tmp/dpfit_federated_features",
        help="folder for the head-mode corpus features ('' = let clients encode)",
    )
    p.add_argument(
        "--no-standardize",
        dest="standardize",
        action="store_false",
        help="head mode: raw pooled features (default: z-scored with validation-split stats)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (runs in parallel)")
    p.add_argument(
        "--from-json",
        default=None,
        help="re-render federated.{md,png} from a recorded federated.json instead of running",
    )
    return p.parse_args(argv)


def run_all(args: argparse.Namespace) -> tuple[list[dict], float]:
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    if args.local_mode == "head" and args.feature_cache:
        torch.set_num_threads(max(args.threads, args.jobs))
        build_feature_cache(args)
        torch.set_num_threads(args.threads)

    specs = [
        (method, eps, seed, overrides)
        for eps in args.epsilons
        for method in args.methods
        for overrides in ([{}] if args.no_tune else GRIDS[method])
        for seed in args.seeds
    ]
    rows: list[dict] = []
    t0 = time.perf_counter()

    def report(r: dict) -> None:
        rows.append(r)
        print(
            f"eps={r['epsilon_target']:g} {r['method']:18s} {r['overrides']} seed={r['seed']} "
            f"test_acc={r['test_accuracy']:.3f} val_acc={r['val_accuracy']:.3f} "
            f"z={r['noise_multiplier']:.3f} C0={r['initial_clip']:.3g} "
            f"C_T={r['final_clip']:.3g} rounds={r['rounds_run']} eps={r['epsilon']:.3f} "
            f"({r['seconds']:.0f}s, {time.perf_counter() - t0:.0f}s total)",
            flush=True,
        )

    if args.jobs <= 1:
        for spec in specs:
            report(_job(spec, args))
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            futures = [pool.submit(_job, spec, args) for spec in specs]
            for fut in as_completed(futures):
                report(fut.result())
    order = {(m, e, s, json.dumps(o, sort_keys=True)): i for i, (m, e, s, o) in enumerate(specs)}
    rows.sort(
        key=lambda r: order[
            (
                r["method"],
                r["epsilon_target"],
                r["seed"],
                json.dumps(r["overrides"], sort_keys=True),
            )
        ]
    )
    return rows, time.perf_counter() - t0


# Keys of a run record as run_one writes them; a recorded file is read back to this schema.
RUN_KEYS = (
    "method", "epsilon_target", "epsilon", "seed", "insecure_seed", "overrides", "val_loss",
    "val_accuracy", "test_accuracy", "test_loss", "noise_multiplier", "update_multiplier",
    "rounds_run", "stop_reason", "vote_counts", "initial_clip", "final_clip", "clips",
    "val_accuracies", "seconds",
)  # fmt: skip


def load_recorded(path: Path) -> tuple[dict, list[dict], float]:
    """(settings, runs, seconds) of a recorded federated.json, runs in today's schema.

    Runs recorded before ``insecure_seed`` existed seeded the server's sampling and noise
    with their seed, exactly what ``insecure_seed`` does now, so they are marked so; keys
    no longer written (a per-run mean of exact client counts) are dropped.
    """
    data = json.loads(path.read_text())
    runs = [
        {k: dict(r, insecure_seed=r.get("insecure_seed", True)).get(k) for k in RUN_KEYS}
        for r in data["runs"]
    ]
    seconds = data.get("seconds")
    return data["settings"], runs, math.nan if seconds is None else float(seconds)


def _fmt_range(xs: list[float], digits: int = 2) -> str:
    lo, hi = min(xs), max(xs)
    return (
        f"{lo:.{digits}f}"
        if round(lo, digits) == round(hi, digits)
        else (f"{lo:.{digits}f}-{hi:.{digits}f}")
    )


def _signed(x: float) -> str:
    return f"{x:+.3f}"


def render(settings: dict, rows: list[dict], elapsed: float, out: Path) -> None:
    """Tables (markdown), the raw runs (JSON) and a plot, all computed from ``rows``."""
    epsilons = [float(e) for e in settings["epsilons"]]
    seeds = list(settings["seeds"])
    no_tune = bool(settings["no_tune"])
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]

    def runs(method: str, eps: float | None = None, overrides: dict | None = None) -> list[dict]:
        return [
            r
            for r in rows
            if r["method"] == method
            and (eps is None or r["epsilon_target"] == eps)
            and (overrides is None or r["overrides"] == overrides)
        ]

    def mean_of(method: str, eps: float, overrides: dict, key: str) -> float:
        return statistics.mean(r[key] for r in runs(method, eps, overrides))

    def sd(xs: list[float]) -> float:
        return statistics.stdev(xs) if len(xs) > 1 else 0.0

    def default_of(method: str) -> dict:
        return {} if no_tune else DEFAULTS[method]

    def by_seed(method: str, eps: float | None = None) -> list[float]:
        """Default setting's test accuracy per seed (eps-averaged when eps is None)."""
        out_ = []
        for s in seeds:
            xs = [
                r["test_accuracy"] for r in runs(method, eps, default_of(method)) if r["seed"] == s
            ]
            out_.append(statistics.mean(xs))
        return out_

    table = []
    for method in methods:
        default = default_of(method)
        line: dict = {"method": method, "runs_to_tune": len(GRIDS[method])}
        for eps in epsilons:
            xs = [r["test_accuracy"] for r in runs(method, eps, default)]
            line[f"default@{eps:g}"] = statistics.mean(xs)
            line[f"default_sd@{eps:g}"] = sd(xs)
            if not no_tune:
                best = max(
                    GRIDS[method], key=lambda o, e=eps: mean_of(method, e, o, "val_accuracy")
                )
                line[f"tuned@{eps:g}"] = mean_of(method, eps, best, "test_accuracy")
                line[f"tuned_choice@{eps:g}"] = best
        line["default_mean"] = statistics.mean(line[f"default@{e:g}"] for e in epsilons)
        line["default_mean_by_seed"] = by_seed(method)
        line["default_mean_sd"] = sd(line["default_mean_by_seed"])
        table.append(line)

    head = ["method", "runs to tune"]
    head += [f"eps={e:g} default" for e in epsilons]
    if not no_tune:
        head += [f"eps={e:g} tuned" for e in epsilons]
    head += ["mean default"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for line in table:
        cells = [line["method"], str(line["runs_to_tune"])]
        cells += [
            f"{line[f'default@{e:g}']:.3f} ± {line[f'default_sd@{e:g}']:.3f}" for e in epsilons
        ]
        if not no_tune:
            cells += [f"{line[f'tuned@{e:g}']:.3f}" for e in epsilons]
        cells += [f"{line['default_mean']:.3f} ± {line['default_mean_sd']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")

    # noise and budget actually used, per method and epsilon (default setting)
    noise = ["| method | eps target | z (combined) | z on the update | eps spent | rounds run |"]
    noise.append("|---|---|---|---|---|---|")
    for method in methods:
        for eps in epsilons:
            rs = runs(method, eps, default_of(method))
            noise.append(
                f"| {method} | {eps:g} | {_fmt_range([r['noise_multiplier'] for r in rs], 3)} "
                f"| {_fmt_range([r['update_multiplier'] for r in rs], 3)} "
                f"| {_fmt_range([r['epsilon'] for r in rs], 3)} "
                f"| {_fmt_range([r['rounds_run'] for r in rs], 0)} |"
            )

    # the tuning grids: test accuracy, validation accuracy (what tuning sees) in brackets
    grids = []
    if not no_tune:
        for method in methods:
            if len(GRIDS[method]) < 2:
                continue
            names = [", ".join(f"{k}={v:g}" for k, v in o.items()) for o in GRIDS[method]]
            grids.append(f"{method}:")
            grids.append("")
            grids.append("| eps | " + " | ".join(names) + " |")
            grids.append("|---|" + "---|" * len(names))
            for eps in epsilons:
                cells = [
                    f"{mean_of(method, eps, o, 'test_accuracy'):.3f} "
                    f"({mean_of(method, eps, o, 'val_accuracy'):.3f})"
                    for o in GRIDS[method]
                ]
                grids.append(f"| {eps:g} | " + " | ".join(cells) + " |")
            grids.append("")

    # DP-LAC minus each other method's default, paired by seed
    paired = []
    if "lac" in methods and len(methods) > 1:
        lac_all = by_seed("lac")
        lac_eps = {e: by_seed("lac", e) for e in epsilons}
        paired.append(
            "| vs | " + " | ".join(["eps-averaged"] + [f"eps={e:g}" for e in epsilons]) + " |"
        )
        paired.append("|---|" + "---|" * (1 + len(epsilons)))
        for method in methods:
            if method == "lac":
                continue
            cols = []
            for lac, other in [(lac_all, by_seed(method))] + [
                (lac_eps[e], by_seed(method, e)) for e in epsilons
            ]:
                diffs = [a - b for a, b in zip(lac, other, strict=True)]
                cols.append(
                    ", ".join(_signed(d) for d in diffs)
                    + f" (mean {_signed(statistics.mean(diffs))})"
                )
            paired.append(f"| {method} | " + " | ".join(cols) + " |")

    # clip norms of the default settings
    clips = ["| method | eps | C_0 | C_T |", "|---|---|---|---|"]
    for method in methods:
        for eps in epsilons:
            rs = runs(method, eps, default_of(method))
            clips.append(
                f"| {method} | {eps:g} | {_fmt_range([r['initial_clip'] for r in rs], 3)} "
                f"| {_fmt_range([r['final_clip'] for r in rs], 3)} |"
            )
    votes = []
    lac_runs = [r for r in rows if r["method"] == "lac" and r["vote_counts"]]
    if lac_runs:
        bins = len(lac_runs[0]["vote_counts"])
        votes.append(
            "DP-LAC's noised vote counts per candidate (min-max over runs): "
            + ", ".join(
                f"bin {i}: {_fmt_range([r['vote_counts'][i] for r in lac_runs], 0)}"
                for i in range(bins)
            )
            + "."
        )

    data = []
    try:
        _, val, test = fed_app.splits(int(settings["data_seed"]))
        k, seed = int(settings["eval_examples"]), int(settings["data_seed"])
        for name, split in (("validation", val), ("test", test)):
            ex = fed_app._subsample(split, k, seed + 1)  # what make_evaluate_fn scores on
            pos = statistics.mean(e.label for e in ex)
            data.append(
                f"| {name} | {len(ex)} | {pos:.3f} | {max(pos, 1 - pos):.3f} | {1 / len(ex):.4f} |"
            )
    except Exception as exc:  # the bundled data is missing: say so rather than guess
        data.append(f"| (evaluation data unavailable: {exc}) | | | | |")

    n_seeds = len(seeds)
    shown = {k: v for k, v in settings.items() if k not in ("out", "from_json")}
    md = [
        "# Federated clip rules at equal client-level privacy",
        "",
        "Generated by `benchmarks/federated.py` from the runs in `federated.json` (re-render with "
        "`--from-json benchmarks/results/federated.json`). Every figure below is computed from "
        "those runs.",
        "",
        f"Test accuracy, mean ± sd over {n_seeds} seed(s) (seed = client sampling, noise, "
        "vote, passed as `insecure_seed` so that methods see the same draws; the data split is "
        "fixed). 'default' is the untuned setting "
        + ", ".join(f"{m} {DEFAULTS[m] or 'as is'}" for m in methods)
        + "; 'tuned' is the grid point with the best final validation accuracy (mean over "
        "seeds), reported on test. 'runs to tune' is the grid size per epsilon (times the seeds).",
        "",
        *lines,
        "",
        "## Evaluation data",
        "",
        "The server's held-out examples that every run is scored on (labels 0/1); 'majority' "
        "is the accuracy of always predicting the more frequent label.",
        "",
        "| split | examples | share of label 1 | majority | one example |",
        "|---|---|---|---|---|",
        *data,
        "",
        "## Noise and budget (default settings)",
        "",
        *noise,
        "",
    ]
    if grids:
        md += [
            "## Tuning grids",
            "",
            "Test accuracy, mean over seeds; validation accuracy, what tuning sees, in brackets.",
            "",
            *grids,
        ]
    if paired:
        md += [
            "## DP-LAC minus each default, paired by seed",
            "",
            "Per seed (same clients sampled, same noise stream), then the mean.",
            "",
            *paired,
            "",
        ]
    md += ["## Clip norms (default settings; min-max over seeds)", "", *clips, "", *votes, ""]
    md += [
        f"{len(rows)} runs"
        + (f" in {elapsed:.0f}s" if math.isfinite(elapsed) else "")
        + ". Settings: "
        + ", ".join(f"{k}={v}" for k, v in shown.items())
        + ".",
        "",
    ]
    print("\n".join(lines))

    out.mkdir(parents=True, exist_ok=True)
    (out / "federated.md").write_text("\n".join(md))
    (out / "federated.json").write_text(
        json.dumps(
            {
                "settings": shown,
                "seconds": elapsed if math.isfinite(elapsed) else None,
                "table": table,
                "runs": rows,
            },
            indent=1,
        )
    )
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        for line in table:
            ax.plot(
                epsilons,
                [line[f"default@{e:g}"] for e in epsilons],
                marker="o",
                label=line["method"],
            )
        ax.set_xlabel("client-level epsilon")
        ax.set_ylabel("test accuracy (untuned)")
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "federated.png", dpi=110)
        plt.close(fig)
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        settings, rows, elapsed = load_recorded(Path(args.from_json))
    else:
        rows, elapsed = run_all(args)
        settings = vars(args)
    render(settings, rows, elapsed, Path(args.out))


if __name__ == "__main__":
    main()

"""Federated clip rules under the DP-LAC paper's protocol: untuned, and privately tuned baselines.

Every method trains the same clients at the same client-level epsilon (noise calibrated per
method), with the same client sampling and noise streams per seed (the seed is passed as
``insecure_seed``: a benchmark compares methods on the same draws, so its runs are not private).

- "default": every method untuned (C = 1, median quantile target, decay 0.5, DP-LAC as is).
- "private tuning": each baseline (fixed, adaptive-quantile, automatic, dynamic) picks its
  hyperparameter from a grid by a private selection (``dpfit.federated.tuning``: Papernot &
  Steinke 2022, K ~ truncated negative binomial candidate runs, only the best released) that
  spends ``--tuning-share`` (1/3, as the paper) of the target; the final run is calibrated so
  that selection + training compose to the target, and its reported epsilon includes both.
  DP-LAC and DP-CLAC have no hyperparameter to tune and train on the whole budget; DP-LAC's
  "tuning" is its vote, timed inside its run.
- C0 quality: for each DP-LAC run the benchmark recomputes every client's candidate losses
  in its own process (non-privately, with the library's client functions; a vote reply
  carries only the one-hot vote) to compare the noised histogram's pick C_hist with the
  non-private best candidate C* (lowest mean candidate loss over all clients) and with the
  mode of the un-noised votes.

Tasks: ``--local-mode head`` (linear head on frozen MiniLM features, encoded once into
``--feature-cache``), ``--local-mode bias`` (BiTFiT clients fine-tuning MiniLM's biases and
head), ``--local-mode lora --model smollm2`` (LoRA clients on SmolLM2-135M). ``--model``
names the bundled model (``minilm``, the default) or a local path.

Partitions: ``iid`` (flwr-datasets IidPartitioner), ``dirichlet`` (its DirichletPartitioner),
``dirichlet-client``: every client gets floor(train / N) examples with its own label mix
p_i ~ Dir(alpha * K * prior) (Hsu et al. 2019), the many-small-clients regime client-level DP
needs. ``--partitions`` takes several.

    # the recorded (reduced) run: see benchmarks/results/federated_protocol.md for its settings;
    # one invocation per epsilon, then merged into one table
    python benchmarks/federated.py --partitions iid --epsilons 8 --seeds 0 1 --rounds 10 \\
        --out /tmp/fed --name federated_protocol_eps8
    python benchmarks/federated.py --partitions iid --epsilons 2 --seeds 0 1 --rounds 10 \\
        --out /tmp/fed --name federated_protocol_eps2
    python benchmarks/federated.py --from-json /tmp/fed/federated_protocol_eps8.json \\
        /tmp/fed/federated_protocol_eps2.json --name federated_protocol
    # the full protocol (two tasks x two partitions x eps 2/4/8 x 3 seeds; see
    # benchmarks/results/federated_history.md, "Benchmark protocol", for the time it takes)
    python benchmarks/federated.py --local-mode bias --partitions iid dirichlet-client \\
        --seeds 0 1 2 --name federated_protocol_minilm_bias
    python benchmarks/federated.py --local-mode lora --model smollm2 \\
        --partitions iid dirichlet-client --seeds 0 1 2 --name federated_protocol_smollm2_lora
    python benchmarks/federated.py --from-json benchmarks/results/federated_protocol.json
                                                    # re-render md/png from recorded runs

Writes ``<out>/<name>.{md,json,png}``; every figure in the markdown is computed from the runs
recorded in the JSON.
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
from harness.records import read_jsonl

from dpfit.federated import app as fed_app
from dpfit.federated import client as fed_client
from dpfit.federated.accounting import calibrate_noise_multiplier
from dpfit.federated.app import LocalGrid, make_evaluate_fn, run_local
from dpfit.federated.cli import LOCAL_LR
from dpfit.federated.client import TaskConfig
from dpfit.federated.clipping import LacClip, clip_rule_class, one_hot_vote
from dpfit.federated.strategy import ServerConfig
from dpfit.federated.tuning import (
    SelectionConfig,
    TuningPlan,
    plan_tuning,
    private_selection,
    run_event,
    selection_rng,
    tuning_event,
)

METHODS = ("fixed", "adaptive-quantile", "automatic", "dynamic", "lac", "clac")
# Each baseline's grid: what a practitioner would try. Every point spends the same per run
# (the selection's bound takes one candidate's RDP), so the dynamic rule tunes its C_0 and
# its clip decay rate rho_c (the decay belongs in its grid; 1 = no decay) at the
# default noise decay, which would change a candidate's privacy cost. LAC and CLAC add no
# hyperparameter.
GRIDS: dict[str, list[dict]] = {
    "fixed": [{"initial_clip": c} for c in (0.1, 0.3, 1.0, 3.0)],
    "adaptive-quantile": [{"target_quantile": g} for g in (0.3, 0.5, 0.7)],
    "automatic": [{"initial_clip": r} for r in (0.1, 0.3, 1.0, 3.0)],
    "dynamic": [
        {"initial_clip": c, "clip_decay": d} for c in (0.3, 1.0, 3.0) for d in (0.25, 0.5, 1.0)
    ],
}
# The untuned setting of each method: C = 1, median target (Andrew et al.), decay 0.5.
DEFAULTS: dict[str, dict] = {
    "fixed": {"initial_clip": 1.0},
    "adaptive-quantile": {"target_quantile": 0.5},
    "automatic": {"initial_clip": 1.0},
    "dynamic": {"initial_clip": 1.0},
    "lac": {},
    "clac": {},
}
MODELS = {"minilm": ""}  # bundled names -> TaskConfig.model ("" is the bundled MiniLM)

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


def stratified_subsample(examples: list, k: int, seed: int) -> list:
    """k examples with the split's class proportions (300 random validation
    examples, 69% one class, made private tuning's picks close to random)."""
    if k <= 0 or k >= len(examples):
        return examples
    rng = np.random.default_rng(seed)
    out = []
    for y in sorted({e.label for e in examples}):
        idx = [i for i, e in enumerate(examples) if e.label == y]
        take = round(k * len(idx) / len(examples))
        out += [int(i) for i in rng.choice(idx, size=take, replace=False)]
    return [examples[i] for i in sorted(out)]


_APP_EVAL_SPLIT = fed_app.eval_split


def _stratified_eval_split(task: TaskConfig, which: str = "validation"):
    """The server's validation examples, stratified; the test split as the app draws it."""
    if which != "validation":
        return _APP_EVAL_SPLIT(task, which)
    _, val, _ = fed_app.splits(task.seed)
    data = stratified_subsample(val, task.eval_examples, task.seed + 1)
    return [e.text for e in data], [e.label for e in data]


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
    return Path(args.feature_cache) / f"minilm_features_len{args.max_length}.pt"


def build_feature_cache(args: argparse.Namespace) -> Path:
    from dpfit.data.bundled import rotten_tomatoes

    path = feature_cache_path(args)
    if path.exists():
        return path
    lm = fed_client.load_local_model("", "head", 4, 0)
    texts = sorted({e.text for e in rotten_tomatoes()}, key=len)
    outs = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), 128):
            ids = lm.encode(texts[i : i + 128], args.max_length)
            outs.append(lm.model.features(**lm.batch(ids)))  # the client's own pooling
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


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


class TimedGrid(LocalGrid):
    """LocalGrid that times the vote (DP-LAC's "tuning" time); replies pass through as is."""

    vote_seconds: float = 0.0

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import MessageType

        messages = list(messages)
        query = bool(messages) and messages[0].metadata.message_type == MessageType.QUERY
        t0 = time.perf_counter()
        replies = super().send_and_receive(messages, timeout=timeout)
        if query:
            self.vote_seconds += time.perf_counter() - t0
        return replies


def task_config(args: argparse.Namespace, partition: str) -> TaskConfig:
    return TaskConfig(
        model=MODELS.get(args.model, args.model),
        local_mode=args.local_mode,
        max_length=args.max_length,
        local_epochs=args.local_epochs,
        local_batch_size=args.local_batch_size,
        lr=args.lr if args.lr is not None else LOCAL_LR[args.local_mode],
        num_clients=args.clients,
        partition=partition,
        alpha=args.alpha,
        examples_per_client=args.examples_per_client,
        eval_examples=args.eval_examples,
        seed=args.data_seed,
    )


def server_config(method: str, eps: float, args: argparse.Namespace) -> ServerConfig:
    fixed_z = getattr(args, "noise_multiplier", None)
    return ServerConfig(
        method=method,
        num_clients=args.clients,
        clients_per_round=args.clients_per_round,
        rounds=args.rounds,
        target_epsilon=eps if fixed_z is None else None,
        noise_multiplier=fixed_z,
        delta=args.delta,
        **DEFAULTS[method],
    )


def _setup(args: argparse.Namespace) -> None:
    _install_partitions()
    if args.stratified_validation:  # this process only, like the partitions
        fed_app.eval_split = _stratified_eval_split
    if args.local_mode == "head" and args.feature_cache:
        _install_features(feature_cache_path(args), args.standardize, args.data_seed)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("dpfit").setLevel(logging.ERROR)  # the insecure-seed warning, per run


def train_once(cfg: ServerConfig, task: TaskConfig, test: bool = True) -> dict:
    """One run of the app in this process; what the tables need from it."""
    grid = TimedGrid.for_app(fed_client.build_client_app(), task.num_clients)
    t0 = time.perf_counter()
    server = run_local(cfg, task, grid=grid)
    out = {
        "epsilon": server.accountant.epsilon(),
        "noise_multiplier": server.noise_multiplier,
        "update_multiplier": server.rule.update_multiplier,
        "rounds_run": len(server.history),
        "stop_reason": server.stop_reason,
        "val_loss": server.history[-1].val_loss if server.history else math.nan,
        "val_accuracy": server.history[-1].accuracy if server.history else math.nan,
        "initial_clip": server.initial_clip,
        "final_clip": server.rule.clip_norm,
        "clips": [r.clip_norm for r in server.history],
        "vote_counts": server.vote_counts,
        "vote_seconds": grid.vote_seconds,
        "seconds": time.perf_counter() - t0,
    }
    if isinstance(server.rule, LacClip):
        losses = all_candidate_losses(
            task,
            tuple(server.rule.candidates()),
            server.rule.update_multiplier,
            float(cfg.clients_per_round),
        )
        out["c0"] = c0_quality(server.rule.candidates(), server.initial_clip, losses)
    if test:
        out["test_loss"], out["test_accuracy"] = make_evaluate_fn(task, "test")(server.params)
    return out


@functools.lru_cache(maxsize=8)
def all_candidate_losses(
    task: TaskConfig, candidates: tuple[float, ...], z_update: float, m: float
) -> np.ndarray:
    """Every client's candidate losses, computed here, outside the federation (benchmark only).

    Each client's local update and noisy trial aggregates are recomputed in this process with
    the library's own functions and the generator a client derives for its vote (data seed,
    partition id, round 0), so these are the losses each client's vote was cast on. They never
    come from a reply: a vote reply carries the one-hot vote alone. They depend on the data
    seed, the candidates, z and m, not on the run's seed: cached per process.
    """
    lm = fed_client.load_local_model(task.model, task.local_mode, task.lora_r, task.seed)
    start = fed_app.initial_arrays(task)
    rows = []
    for pid in range(task.num_clients):
        examples = fed_app.client_examples(task, pid)
        texts, labels = [e.text for e in examples], [e.label for e in examples]
        rng = np.random.default_rng([task.seed, pid, 0])
        update, _ = fed_client.local_train(lm, start, texts, labels, task, rng)
        rows.append(
            fed_client.candidate_losses(
                lm,
                start,
                update,
                texts,
                labels,
                list(candidates),
                z_update,
                m,
                task.max_length,
                rng,
            )  # fmt: skip
        )
    return np.asarray(rows, dtype=np.float64)


def c0_quality(candidates: list[float], c_hist: float, losses: np.ndarray) -> dict:
    """C_hist (the noised histogram's pick) against C* (lowest mean candidate loss, no noise).

    ``losses``: clients x candidates, from ``all_candidate_losses`` (never from replies).
    """
    clean = np.sum([one_hot_vote(row) for row in losses], axis=0)
    mean_loss = np.nanmean(losses, axis=0)
    star = int(np.nanargmin(mean_loss))
    hist = candidates.index(c_hist) if c_hist in candidates else -1
    return {
        "candidates": candidates,
        "c_hist": c_hist,
        "c_star": candidates[star],
        "c_clean_vote": candidates[int(np.argmax(clean))],
        "clean_votes": clean.tolist(),
        "mean_loss": mean_loss.tolist(),
        "loss_regret": float(mean_loss[hist] - mean_loss[star]) if hist >= 0 else math.nan,
        "voters": len(losses),
    }


def run_default(method: str, eps: float, seed: int, partition: str, args) -> dict:
    _setup(args)
    cfg = replace(server_config(method, eps, args), insecure_seed=seed)
    return {
        "protocol": "default",
        "method": method,
        "partition": partition,
        "epsilon_target": eps,
        "seed": seed,
        "hyperparameters": DEFAULTS[method],
        "tuning_seconds": 0.0,
        **train_once(cfg, task_config(args, partition)),
    }


def run_tuned(
    method: str, eps: float, seed: int, partition: str, plan: TuningPlan, z_final: float, args
) -> dict:
    """Private selection over the grid at the plan's candidate noise, then the final run."""
    _setup(args)
    task = task_config(args, partition)
    scores: list[dict] = []

    def candidate(point: dict, i: int) -> float:
        # each candidate is an independent run: its own (insecure, benchmark) noise stream
        cfg = replace(plan.candidate, insecure_seed=10_000 * (seed + 1) + i, **point)
        r = train_once(cfg, task, test=False)
        scores.append({"hyperparameters": point, "val_accuracy": r["val_accuracy"]})
        return r["val_accuracy"]

    t0 = time.perf_counter()
    rng = selection_rng(insecure_seed=seed * 1_000 + METHODS.index(method) * 10 + int(eps))
    sel = private_selection(GRIDS[method], candidate, plan.selection, rng)
    tuning_seconds = time.perf_counter() - t0
    point = dict(sel.choice) if sel.choice is not None else DEFAULTS[method]
    # z_final was calibrated (selection + training = target) once per method and epsilon
    final = replace(plan.final, insecure_seed=seed, noise_multiplier=z_final, **point)
    out = train_once(final, task)
    if out["epsilon"] > eps * (1 + 1e-3):
        raise RuntimeError(f"{method} eps={eps}: tuned run spent {out['epsilon']} > target")
    return {
        "protocol": "private tuning",
        "method": method,
        "partition": partition,
        "epsilon_target": eps,
        "seed": seed,
        "hyperparameters": point,
        "tuning_seconds": tuning_seconds,
        "tuning_runs": sel.runs,
        "candidate_scores": scores,
        "candidate_noise_multiplier": plan.candidate_noise_multiplier,
        "tuning_epsilon": plan.tuning_epsilon,
        **out,
    }


def make_plan(method: str, eps: float, args) -> tuple[TuningPlan, float]:
    """The budget split of one method at one epsilon, and the final run's multiplier.

    Two calibrations each; the multipliers are kept in ``--plan-cache`` (keyed by every
    setting they depend on) so that runs split over several invocations share them.
    """
    cfg = server_config(method, eps, args)
    selection = SelectionConfig(args.tuning_mean_runs, args.tuning_shape, args.tuning_share)
    rule = clip_rule_class(method)
    key = json.dumps([repr(run_event(cfg, 1.0)), eps, cfg.delta, repr(selection)])
    cache = Path(args.plan_cache) if args.plan_cache else None
    known = json.loads(cache.read_text()) if cache and cache.exists() else {}
    if key in known:
        z_tune, tuning_eps, cand_eps, z = known[key]
        plan = TuningPlan(
            candidate=replace(cfg, target_epsilon=None, noise_multiplier=z_tune),
            final=replace(
                cfg,
                tuning_noise_multiplier=z_tune,
                tuning_mean_runs=selection.mean_runs,
                tuning_shape=selection.shape,
            ),
            candidate_noise_multiplier=z_tune,
            selection=selection,
            tuning_epsilon=tuning_eps,
            candidate_epsilon=cand_eps,
        )
        return plan, z
    plan = plan_tuning(cfg, GRIDS[method], selection)
    final = plan.final
    z = calibrate_noise_multiplier(
        eps,
        final.delta,
        final.sample_rate,
        final.rounds,
        rule.one_off_multipliers(final.clip_config(1.0)),
        final.accountant,
        schedule=(
            (lambda z: rule.schedule(final.clip_config(z), final.rounds))
            if rule.scheduled
            else None
        ),
        prior=tuning_event(final),
    )
    if cache:
        known = json.loads(cache.read_text()) if cache.exists() else {}
        known[key] = [
            plan.candidate_noise_multiplier,
            plan.tuning_epsilon,
            plan.candidate_epsilon,
            z,
        ]
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known))
    return plan, z


def _call(fn, *a):
    return fn(*a)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument(
        "--partitions",
        nargs="+",
        default=["iid", "dirichlet-client"],
        choices=("dirichlet-client", "dirichlet", "iid", "movie"),
    )
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration")
    p.add_argument("--clients", type=int, default=1000, help="population N")
    p.add_argument(
        "--clients-per-round", type=float, default=100, help="expected m (Poisson, q = m/N)"
    )
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument(
        "--noise-multiplier",
        type=float,
        default=None,
        help="fix z instead of calibrating to each epsilon (with --no-tune); 0 = non-private",
    )
    p.add_argument("--model", default="minilm", help="bundled name (minilm, smollm2) or a path")
    p.add_argument("--local-mode", default="head", choices=fed_client.LOCAL_MODES)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--local-batch-size", type=int, default=16)
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="client lr (default: by local mode, as dpfit federated)",
    )
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--examples-per-client", type=int, default=10, help="cap; 0 = all")
    p.add_argument("--eval-examples", type=int, default=600)
    p.add_argument(
        "--stratified-validation",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="validation examples with the split's class proportions (what tuning scores on)",
    )
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--no-tune", action="store_true", help="only the default rows")
    p.add_argument("--tuning-share", type=float, default=1 / 3, help="of each target epsilon")
    p.add_argument("--tuning-mean-runs", type=float, default=3.0, help="E[K] candidate runs")
    p.add_argument(
        "--tuning-shape",
        type=float,
        default=1.0,
        help="eta of K's truncated negative binomial (1 geometric, 0 logarithmic, inf Poisson)",
    )
    p.add_argument(
        "--plan-cache",
        default="/tmp/dpfit_federated_plans.json",
        help="file keeping the tuning budget splits between invocations ('' = none)",
    )
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="federated_protocol", help="output file stem")
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
        nargs="+",
        default=None,
        help="re-render <name>.{md,png} from recorded JSONs (several are merged)",
    )
    return p.parse_args(argv)


def run_all(args: argparse.Namespace) -> tuple[list[dict], float]:
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    if args.local_mode == "head" and args.feature_cache:
        build_feature_cache(args)
    if args.noise_multiplier is not None and not args.no_tune:
        raise SystemExit("--noise-multiplier fixes the noise: add --no-tune (nothing to split)")
    tuned = [] if args.no_tune else [m for m in args.methods if m in GRIDS]
    t0 = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    rows: list[dict] = []

    def report(r: dict) -> None:
        rows.append(r)
        extra = (
            f" picked {r['hyperparameters']} after {r['tuning_runs']} runs "
            f"({r['tuning_seconds']:.0f}s)"
            if r["protocol"] != "default"
            else ""
        )
        print(
            f"[{time.perf_counter() - t0:.0f}s] {r['partition']} eps={r['epsilon_target']:g} "
            f"{r['method']} {r['protocol']} seed={r['seed']}: test_acc={r['test_accuracy']:.3f} "
            f"eps={r['epsilon']:.3f} C0={r['initial_clip']:.3g} ({r['seconds']:.0f}s){extra}",
            flush=True,
        )

    # every finished run is appended here at once, so an interrupted run keeps what it did
    partial = Path(args.out) / f"{args.name}.partial.jsonl"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text(json.dumps({"settings": _settings(args)}) + "\n")

    def keep(r: dict) -> None:
        report(r)
        with partial.open("a") as f:
            f.write(json.dumps(r) + "\n")

    with ProcessPoolExecutor(max(1, args.jobs), mp_context=ctx) as pool:
        # seed by seed, so that the first seeds finish first; the budget splits are computed
        # here while the pool trains the first defaults, and methods with the same per-run
        # event (fixed, automatic) share one calibration through the plan cache
        futs = []
        plans: dict = {}
        for s in args.seeds:
            futs += [
                pool.submit(_call, run_default, m, e, s, part, args)
                for part in args.partitions
                for e in args.epsilons
                for m in args.methods
            ]
            if not plans:
                plans = {(m, e): make_plan(m, e, args) for m in tuned for e in args.epsilons}
            futs += [
                pool.submit(_call, run_tuned, m, e, s, part, *plans[(m, e)], args)
                for part in args.partitions
                for e in args.epsilons
                for m in tuned
            ]
        for fut in as_completed(futs):
            keep(fut.result())
    key = {
        (p, e, s, m, proto): i
        for i, (p, e, s, m, proto) in enumerate(
            (p, e, s, m, proto)
            for p in args.partitions
            for e in args.epsilons
            for s in args.seeds
            for m in METHODS
            for proto in ("default", "private tuning")
        )
    }
    rows.sort(
        key=lambda r: key[
            (r["partition"], r["epsilon_target"], r["seed"], r["method"], r["protocol"])
        ]
    )
    return rows, time.perf_counter() - t0


def _settings(args: argparse.Namespace) -> dict:
    skip = ("out", "from_json", "name", "plan_cache")
    return {k: v for k, v in vars(args).items() if k not in skip}


def load_partial(path: Path) -> tuple[dict, list[dict], float]:
    """The runs of an interrupted invocation (``<name>.partial.jsonl``): a seed's default
    (or privately tuned) runs are kept if all of them finished for every method, partition
    and epsilon; tables then say which seeds each row has."""
    lines = read_jsonl(Path(path))
    settings, runs = dict(lines[0]["settings"]), lines[1:]
    keep = []
    for proto in ("default", "private tuning"):
        methods = [m for m in settings["methods"] if proto == "default" or m in GRIDS]
        want = {
            (m, p, float(e))
            for m in methods
            for p in settings["partitions"]
            for e in settings["epsilons"]
        }
        for s in settings["seeds"]:
            rs = [r for r in runs if r["seed"] == s and r["protocol"] == proto]
            got = {(r["method"], r["partition"], float(r["epsilon_target"])) for r in rs}
            if want <= got:
                keep += rs
    settings["seeds"] = sorted({r["seed"] for r in keep})
    return settings, keep, math.nan


def load_recorded(*paths: Path) -> tuple[dict, list[dict], float]:
    """(settings, runs, seconds) of recorded JSONs; several (e.g. one per seed, run one after
    the other) merge into one record if they differ only in seeds, epsilons and jobs."""
    settings: dict = {}
    runs: list[dict] = []
    seconds = 0.0
    for path in paths:
        if str(path).endswith(".jsonl"):
            st, rs, _ = load_partial(path)
            data = {"settings": st, "runs": rs, "seconds": None}
        else:
            data = json.loads(Path(path).read_text())
        s = dict(data["settings"])
        if settings:
            same = {k for k in s if k not in ("seeds", "epsilons", "jobs")}
            diff = [k for k in same if s[k] != settings.get(k)]
            if diff:
                raise SystemExit(f"{path} was run with other settings: {diff}")
            for k in ("seeds", "epsilons"):
                s[k] = sorted(set(settings[k]) | set(s[k]))
        settings = s
        runs += data["runs"]
        seconds += math.nan if data.get("seconds") is None else float(data["seconds"])
    return settings, runs, seconds


# --------------------------------------------------------------------------------------------
# Tables and plot, computed from the recorded runs only
# --------------------------------------------------------------------------------------------


def _fmt_range(xs: list[float], digits: int = 2) -> str:
    lo, hi = min(xs), max(xs)
    same = round(lo, digits) == round(hi, digits)
    return f"{lo:.{digits}f}" if same else f"{lo:.{digits}f}-{hi:.{digits}f}"


def _mean_sd(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.3f} ± {sd:.3f}"


def _hp(point: dict) -> str:
    return ", ".join(f"{k}={v:g}" for k, v in point.items()) or "-"


def _evaluation_data(settings: dict) -> list[str]:
    out = []
    try:
        _, val, test = fed_app.splits(int(settings["data_seed"]))
        k, seed = int(settings["eval_examples"]), int(settings["data_seed"])
        for name, split in (("validation", val), ("test", test)):
            if name == "validation" and settings.get("stratified_validation"):
                ex = stratified_subsample(split, k, seed + 1)
            else:
                ex = fed_app._subsample(split, k, seed + 1)  # what make_evaluate_fn scores on
            pos = statistics.mean(e.label for e in ex)
            out.append(f"| {name} | {len(ex)} | {pos:.3f} | {max(pos, 1 - pos):.3f} |")
    except Exception as exc:  # the bundled data is missing: say so rather than guess
        out.append(f"| (evaluation data unavailable: {exc}) | | | |")
    return out


def render(settings: dict, rows: list[dict], elapsed: float, out: Path, name: str) -> None:
    """Markdown tables, the raw runs (JSON) and a plot of C_t, all computed from ``rows``."""
    epsilons = [float(e) for e in settings["epsilons"]]
    seeds = list(settings["seeds"])
    partitions = list(settings["partitions"])
    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]

    def pick(method, protocol, partition=None, eps=None, seed=None) -> list[dict]:
        return [
            r
            for r in rows
            if r["method"] == method
            and r["protocol"] == protocol
            and (partition is None or r["partition"] == partition)
            and (eps is None or r["epsilon_target"] == eps)
            and (seed is None or r["seed"] == seed)
        ]

    def by_seed(method, protocol, partition, eps=None) -> dict[int, float]:
        """Test accuracy per seed that ran (averaged over the epsilons when eps is None)."""
        out = {}
        for s in seeds:
            rs = pick(method, protocol, partition, eps, s)
            if rs:
                out[s] = statistics.mean(r["test_accuracy"] for r in rs)
        return out

    def rows_of(method: str) -> list[str]:
        # DP-LAC and DP-CLAC are untuned in both protocols: one row
        return ["default"] + (["private tuning"] if method in GRIDS else [])

    md = [
        "# Federated clip rules under the DP-LAC paper's protocol",
        "",
        f"Generated by `benchmarks/federated.py` from the runs in `{name}.json` (re-render with "
        f"`--from-json benchmarks/results/{name}.json`). Every figure below is computed from "
        "those runs.",
        "",
        f"Test accuracy, mean ± sd over the seeds each row ran ({len(seeds)} seed(s) in all; "
        "seed = client sampling, noise, "
        "vote, selection draws; passed as insecure seeds so that methods see the same draws; "
        "the data split is fixed). 'default': untuned ("
        + "; ".join(f"{m} {_hp(DEFAULTS[m])}" for m in methods)
        + "). 'private tuning': the baseline's hyperparameter chosen by a private selection "
        "(Papernot & Steinke 2022, truncated negative binomial number of candidate runs, best "
        "validation accuracy released) spending "
        f"{settings['tuning_share']:.3g} of the target, then trained on the rest; 'eps spent' "
        "is the total, tuning included. 'tuning s' is the wall time of the selection's "
        "candidate runs (DP-LAC: its vote), mean over runs, measured on a shared machine; 'x "
        "DP-LAC vote' divides it by DP-LAC's mean vote time.",
        "",
    ]
    table: list[dict] = []
    for part in partitions:
        head = ["method", "protocol"] + [f"eps={e:g}" for e in epsilons]
        head += ["mean over eps", "eps spent (max/target)", "tuning s", "x DP-LAC vote"]
        head += ["runs per tuning", "seeds"]
        lac_vote = [r["vote_seconds"] for r in pick("lac", "default", part)]
        md += [f"## {part}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for m in methods:
            for proto in rows_of(m):
                rs = pick(m, proto, part)
                if not rs:
                    continue
                line = {"partition": part, "method": m, "protocol": proto}
                cells = [m, proto]
                for e in epsilons:
                    xs = [r["test_accuracy"] for r in pick(m, proto, part, e)]
                    line[f"acc@{e:g}"] = statistics.mean(xs)
                    cells.append(_mean_sd(xs))
                line["mean_by_seed"] = list(by_seed(m, proto, part).values())
                line["seeds"] = list(by_seed(m, proto, part))
                cells.append(_mean_sd(line["mean_by_seed"]))
                spent = max(r["epsilon"] / r["epsilon_target"] for r in rs)
                tune = (
                    [r["tuning_seconds"] for r in rs]
                    if proto != "default"
                    else [r["vote_seconds"] for r in rs]
                )
                runs = [r.get("tuning_runs", 0) for r in rs]
                cells += [f"{spent:.4f}", f"{statistics.mean(tune):.0f}"]
                ratio = statistics.mean(tune) / statistics.mean(lac_vote) if lac_vote else 0.0
                cells.append(f"{ratio:.1f}" if lac_vote and ratio > 0 else "-")
                cells.append(f"{statistics.mean(runs):.1f}" if proto != "default" else "0")
                cells.append(", ".join(str(k) for k in line["seeds"]))
                md.append("| " + " | ".join(cells) + " |")
                table.append(line)
        md.append("")

        # DP-LAC minus each other row, paired by seed
        if "lac" in methods:
            lac = by_seed("lac", "default", part)
            md += [
                f"DP-LAC minus each row, paired by seed, mean over eps ({part}): per seed, "
                "then the mean.",
                "",
                "| vs | protocol | per seed | mean |",
                "|---|---|---|---|",
            ]
            for m in methods:
                for proto in rows_of(m):
                    if m == "lac" or not pick(m, proto, part):
                        continue
                    other = by_seed(m, proto, part)
                    d = {k: lac[k] - other[k] for k in lac if k in other}
                    md.append(
                        f"| {m} | {proto} | "
                        + ", ".join(f"{x:+.3f} (seed {k})" for k, x in d.items())
                        + f" | {statistics.mean(d.values()):+.3f} |"
                    )
            md.append("")

    # the private selections: budget split and what they picked
    tuned = [m for m in methods if pick(m, "private tuning")]
    if tuned:
        md += [
            "## Private tuning: budget split and choices",
            "",
            "z: combined noise multiplier per round (candidates / final tuned run / untuned "
            "run at the same target); 'tuning eps' is what the selection alone spends. "
            "Choices and K (number of candidate runs) per seed: K and the other candidates' "
            "scores are secret in a real deployment and shown here only because the "
            "benchmark's runs are not private anyway.",
            "",
            "| partition | method | eps | z candidates | z final | z untuned | tuning eps "
            "| eps spent | choice (K) per seed |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for part in partitions:
            for m in tuned:
                for e in epsilons:
                    rs = pick(m, "private tuning", part, e)
                    if not rs:
                        continue
                    d = pick(m, "default", part, e)
                    choices = "; ".join(
                        f"{_hp(r['hyperparameters'])} ({r['tuning_runs']})" for r in rs
                    )
                    md.append(
                        f"| {part} | {m} | {e:g} "
                        f"| {_fmt_range([r['candidate_noise_multiplier'] for r in rs], 3)} "
                        f"| {_fmt_range([r['noise_multiplier'] for r in rs], 3)} "
                        f"| {_fmt_range([r['noise_multiplier'] for r in d], 3) if d else '-'} "
                        f"| {_fmt_range([r['tuning_epsilon'] for r in rs], 3)} "
                        f"| {_fmt_range([r['epsilon'] for r in rs], 3)} | {choices} |"
                    )
        md.append("")

    # C0 quality: the vote's pick against the non-private best candidate
    c0 = [r for r in rows if r["method"] == "lac" and r.get("c0")]
    if c0:
        md += [
            "## C0 quality: DP-LAC's histogram pick against the non-private best candidate",
            "",
            "C_hist: the candidate with the most noised votes (what DP-LAC uses). C*: the "
            "candidate with the lowest mean candidate loss over all clients, without noise: "
            "the benchmark recomputes every client's candidate losses itself (the clients' "
            "vote replies carry only their one-hot vote). 'clean vote': "
            "the mode of the un-noised votes. Regret: mean candidate loss at C_hist minus at "
            "C*. Candidates and mean losses are per (partition, eps); they do not depend on "
            "the seed, which only changes the histogram's noise.",
            "",
            "| partition | eps | candidates | mean candidate loss | clean votes | C* "
            "| clean vote | C_hist per seed | C_hist = C* | regret (max) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for part in partitions:
            for e in epsilons:
                rs = [r for r in c0 if r["partition"] == part and r["epsilon_target"] == e]
                if not rs:
                    continue
                q = rs[0]["c0"]
                hits = sum(r["c0"]["c_hist"] == r["c0"]["c_star"] for r in rs)
                md.append(
                    f"| {part} | {e:g} | {', '.join(f'{c:.3g}' for c in q['candidates'])} "
                    f"| {', '.join(f'{x:.4f}' for x in q['mean_loss'])} "
                    f"| {', '.join(f'{x:.0f}' for x in q['clean_votes'])} "
                    f"| {q['c_star']:.3g} | {q['c_clean_vote']:.3g} "
                    f"| {', '.join(format(r['c0']['c_hist'], '.3g') for r in rs)} "
                    f"| {hits}/{len(rs)} | {max(r['c0']['loss_regret'] for r in rs):.4f} |"
                )
        md.append("")

    md += [
        "## Evaluation data",
        "",
        "The server's held-out examples that every run is scored on (labels 0/1); 'majority' "
        "is the accuracy of always predicting the more frequent label.",
        "",
        "| split | examples | share of label 1 | majority |",
        "|---|---|---|---|",
        *_evaluation_data(settings),
        "",
        f"{len(rows)} final runs"
        + (f" in {elapsed:.0f}s wall" if math.isfinite(elapsed) else "")
        + f" ({sum(r.get('tuning_runs', 0) for r in rows)} candidate runs inside the "
        "selections). Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()) + ".",
        "",
    ]
    print("\n".join(md))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(md))
    (out / f"{name}.json").write_text(
        json.dumps(
            {
                "settings": settings,
                "seconds": elapsed if math.isfinite(elapsed) else None,
                "table": table,
                "runs": rows,
            },
            indent=1,
        )
    )
    _plot(rows, methods, epsilons, partitions, out / f"{name}.png")


def _plot(rows, methods, epsilons, partitions, path: Path) -> None:
    """C_t per round of each method (mean over seeds), one panel per partition and epsilon."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    cols = len(epsilons)
    fig, axes = plt.subplots(
        len(partitions), cols, figsize=(3.4 * cols, 2.8 * len(partitions)), squeeze=False
    )
    colors = dict(zip(METHODS, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for i, part in enumerate(partitions):
        for j, e in enumerate(epsilons):
            ax = axes[i][j]
            for m in methods:
                for proto, style in (("default", "-"), ("private tuning", "--")):
                    rs = [
                        r
                        for r in rows
                        if r["method"] == m
                        and r["protocol"] == proto
                        and r["partition"] == part
                        and r["epsilon_target"] == e
                        and r["clips"]
                    ]
                    if not rs:
                        continue
                    n = min(len(r["clips"]) for r in rs)
                    c = np.mean([r["clips"][:n] for r in rs], axis=0)
                    label = m if proto == "default" else f"{m} (tuned)"
                    ax.plot(range(1, n + 1), c, style, color=colors[m], label=label, lw=1.2)
            ax.set_yscale("log")
            ax.set_title(f"{part}, eps={e:g}", fontsize=9)
            ax.set_xlabel("round", fontsize=8)
            if j == 0:
                ax.set_ylabel("clip norm C_t", fontsize=8)
    axes[0][-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.from_json:
        settings, rows, elapsed = load_recorded(*map(Path, args.from_json))
        one = len(args.from_json) == 1 and args.from_json[0].endswith(".json")
        name = Path(args.from_json[0]).stem if one else args.name
        render(settings, rows, elapsed, Path(args.out), name)
        return
    rows, elapsed = run_all(args)
    render(_settings(args), rows, elapsed, Path(args.out), args.name)


if __name__ == "__main__":
    main()

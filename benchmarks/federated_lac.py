"""DP-LAC against the federated clip-rule baselines on fine-tuned clients.

Clients: LoRA r=4 on the bundled MiniLM's top layer (query, value) + that layer's biases + the
head (``--local-mode lora-top``), simulated by the batched engine (``dpfit.federated.batched``:
a round's clients as one computation, frozen lower layers cached once per example) through
the same server core, clip rules and accountant as the Flower engines. Rotten Tomatoes split
by movie (data seed 0): N clients of 10 training examples each (IID), m expected a round,
the server's public validation split in full for DP-LAC, every model scored on the full test
split. Every rule runs untuned (C_init = 1, quantile target 0.5, decay 0.5, vote over
0.25/0.5/1 x C_init with sigma_h from 10% of the budget), with noise calibrated to the same
client-level epsilon; seed s drives client sampling and all noise (``insecure_seed``: a
benchmark's runs are paired by seed, so they are not private), the same s for every rule.

    # the pilot: non-private, 30 rounds, each local optimizer; keep the one whose update
    # norms move with the loss
    python benchmarks/federated_lac.py pilot --out benchmarks/results
    # the protocol (runs appended to <name>.jsonl as they finish; re-running skips them;
    # several workers can share the plan through --claims DIR), one invocation per epsilon
    python benchmarks/federated_lac.py run --epsilons 8 --seeds 0 1 2 --rounds 30 \
        --clients 1000 --clients-per-round 100 --local-optimizer sgd --lr 0.5
    # tables and plots of every recorded protocol (RENDERED), and the section of
    # benchmarks/results/federated_history.md
    python benchmarks/federated_lac.py render

Writes ``<out>/<name>.{jsonl,md,png}`` and ``<name>_setup.jsonl`` (each worker's cache
fill), and ``federated_lac_pilot.{json,md}``; every figure in the markdown is computed from
the recorded runs. ``federated_lac_full`` is the protocol at its stated scale;
``federated_lac`` is an earlier reduced run (N = 500, m = 50, 10 rounds), rendered and
labelled as such.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import numpy as np
from doc_block import write_between_markers

RESULTS = Path(__file__).parent / "results"
METHODS = ("lac", "clac", "adaptive-quantile", "automatic", "dynamic", "fixed")
NON_PRIVATE = "non-private"
NOVOTE = "lac-c0"  # DP-LAC started at a given C0, no vote (dpfit.federated.clipping.lac_novote)
LOCAL_LR = {"adamw": 1e-3, "sgd": 0.1}
# the protocol at its full scale, then the earlier reduced run (N = 500, m = 50, 10 rounds)
RENDERED = ("federated_lac_rerun", "federated_lac_full", "federated_lac")


class RecordingClients:
    """The batched engine, keeping the vote's candidate-loss matrix for the C* comparison
    (benchmark only: a vote reply carries the one-hot vote, never these losses).

    ``memo``: a folder where each vote's loss matrix is kept under a hash of everything it
    is computed from (the task, the model's start, the clients, the candidates, the vote's
    multiplier, the engine's source). The clients' vote draws come from their own
    generators (task seed, client, round 0), not from the run's seed, so DP-LAC at another
    seed (same epsilon) asks the very same query and reads the matrix back instead of
    training all N clients again.
    """

    def __init__(self, engine, memo: Path | None = None) -> None:
        self.engine = engine
        self.memo = memo
        self.last_losses: np.ndarray | None = None
        self.memo_hits = 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _memo_key(self, start, pids, candidates, noise_multiplier, expected_clients) -> str:
        import dpfit.federated.batched as batched
        import dpfit.federated.client as client
        import dpfit.federated.clipping as clipping

        h = hashlib.sha256()
        for mod in (batched, client, clipping):
            h.update(Path(mod.__file__).read_bytes())
        h.update(repr(self.engine.task).encode())
        for a in start:
            h.update(np.ascontiguousarray(a).tobytes())
        h.update(json.dumps([list(map(int, pids)), list(map(float, candidates))]).encode())
        h.update(repr((float(noise_multiplier), float(expected_clients))).encode())
        return h.hexdigest()[:32]

    def candidate_losses(self, start, pids, candidates, noise_multiplier, expected_clients):
        path = None
        if self.memo is not None:
            key = self._memo_key(start, pids, candidates, noise_multiplier, expected_clients)
            path = self.memo / f"vote_{key}.npy"
            if path.exists():
                self.memo_hits += 1
                self.last_losses = np.load(path)
                return self.last_losses
        self.last_losses = self.engine.candidate_losses(
            start, pids, candidates, noise_multiplier, expected_clients
        )
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.npy")
            np.save(tmp, self.last_losses)
            tmp.replace(path)
        return self.last_losses


def setup(args: argparse.Namespace, client_data=None):
    """Task, engine, validation and test data (the cache is shared by every run).

    ``client_data``: partition id -> examples, when the clients are not the IID split's
    (benchmarks/federated_misspec.py's label-skewed clients)."""
    import torch

    from dpfit.federated.app import client_examples, splits
    from dpfit.federated.batched import BatchedClients
    from dpfit.federated.client import TaskConfig, load_local_model

    torch.set_num_threads(1)
    task = TaskConfig(
        model=getattr(args, "model", ""), local_mode="lora-top", lora_r=4, max_length=args.max_length, local_epochs=2,
        local_batch_size=16, lr=args.lr or LOCAL_LR[args.local_optimizer],
        num_clients=args.clients, partition="iid", examples_per_client=10, eval_examples=0,
        seed=0, local_optimizer=args.local_optimizer,
    )  # fmt: skip
    lm = load_local_model(task.model, task.local_mode, task.lora_r, task.seed)
    memo = Path(args.vote_memo) if getattr(args, "vote_memo", None) else None
    client_data = client_data or (lambda p: client_examples(task, p))
    engine = RecordingClients(BatchedClients(lm, task, client_data), memo=memo)
    _, val, test = splits(task.seed)
    val = stratified(val, args.val_examples, seed=task.seed)
    val_data = ([e.text for e in val], [e.label for e in val])
    test_data = ([e.text for e in test], [e.label for e in test])
    t0, c0 = time.perf_counter(), time.process_time()
    cache_file = Path(args.cache_file) if args.cache_file else None
    if cache_file is not None and cache_file.exists():  # the frozen layers' output, reused
        engine.cache.store.update(torch.load(cache_file))
    loaded = len(engine.cache.store)
    engine.cache.fill([e.text for p in range(task.num_clients) for e in client_data(p)])
    engine.cache.fill(val_data[0] + test_data[0])
    if cache_file is not None and len(engine.cache.store) > loaded:  # written only if it grew
        torch.save(engine.cache.store, cache_file)
    logging.info("cache filled in %.0fs", time.perf_counter() - t0)
    setup_cost = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
    return task, engine, val_data, test_data, setup_cost


def stratified(examples: list, k: int, seed: int) -> list:
    """k examples with the split's class proportions (each class sampled without
    replacement), so a validation score is not dominated by the majority class's share."""
    if k <= 0 or k >= len(examples):
        return examples
    rng = np.random.default_rng(seed)
    labels = sorted({e.label for e in examples})
    out = []
    for y in labels:
        idx = [i for i, e in enumerate(examples) if e.label == y]
        take = round(k * len(idx) / len(examples))
        out += [examples[i] for i in rng.choice(idx, size=take, replace=False)]
    return sorted(out, key=lambda e: e.text)


def server_config(method: str, eps: float | None, seed: int, args, clip: float = 1.0):
    """The untuned server of one rule at one epsilon and seed (C_init = ``clip``, 1 unless
    a fixed-rule sweep asks otherwise; non-private: the fixed rule with C = 1e6, no noise)."""
    import dpfit.federated.clipping.lac_novote  # noqa: F401  (registers the no-vote arm)
    from dpfit.federated.strategy import ServerConfig

    private = method != NON_PRIVATE
    return ServerConfig(
        method=method if private else "fixed",
        num_clients=args.clients,
        clients_per_round=args.clients_per_round,
        rounds=args.rounds,
        target_epsilon=eps if private else None,
        noise_multiplier=None if private else 0.0,
        initial_clip=clip if private else 1e6,
        insecure_seed=seed,
        **(
            {"vote_factors": tuple(args.vote_factors)}
            if getattr(args, "vote_factors", None)
            else {}
        ),
    )


def one_run(
    method: str,
    eps: float | None,
    seed: int,
    args,
    task,
    engine,
    val,
    test,
    cfg=None,
    clip: float = 1.0,
) -> dict:
    """One rule at one epsilon and seed; per-round C_t, validation loss, median norm.

    ``cfg``: the server's config when it is not the untuned one (a tuned or candidate run).
    """
    from dpfit.federated.app import initial_arrays
    from dpfit.federated.batched import drive, public_trial
    from dpfit.federated.strategy import DPFedAvgServer

    private = method != NON_PRIVATE
    cfg = cfg or server_config(method, eps, seed, args, clip)
    rounds: list[dict] = []
    t0, c0 = time.perf_counter(), time.process_time()
    trial = public_trial(engine, cfg.method, *val)  # the server's public data, as the CLI's
    server = DPFedAvgServer(cfg, initial_arrays(task), engine.evaluate_fn(*val), trial)
    if method == NOVOTE:  # DP-LAC from the given C0: no vote, v_0 recorded as DP-LAC does
        from dpfit.federated.clipping.lac_novote import start_without_vote

        start_without_vote(server)

    def on_round(rec) -> None:
        rounds.append(
            {
                "round": rec.round,
                "clip_norm": rec.clip_norm,
                "val_loss": rec.val_loss,
                "val_accuracy": rec.accuracy,
                "epsilon": rec.epsilon,
                "median_update_norm": server.last_counts.median_update_norm,
                "seconds": time.perf_counter() - t0,
                "cpu_seconds": time.process_time() - c0,
            }
        )

    engine.last_losses = None
    drive(server, engine, args.clients, on_round)
    test_loss, test_acc = engine.evaluate_fn(*test)(server.params)
    row = {
        "method": method,
        "epsilon_target": eps,
        "seed": seed,
        "local_optimizer": task.local_optimizer,
        "lr": task.lr,
        "rounds_requested": args.rounds,
        "clients": args.clients,
        "clients_per_round": args.clients_per_round,
        "noise_multiplier": server.noise_multiplier,
        "vote_noise_std": server.rule.config.vote_noise_std,
        "epsilon": server.accountant.epsilon() if private else math.inf,
        "test_accuracy": test_acc,
        "test_loss": test_loss,
        "test_examples": len(test[0]),
        "val_examples": len(val[0]),
        "initial_clip": server.initial_clip,
        "vote_counts": server.vote_counts,
        "vote_factors": list(server.rule.config.vote_factors),
        "rounds": rounds,
        "seconds": time.perf_counter() - t0,
        "cpu_seconds": time.process_time() - c0,
        "stopped": server.stop_reason,
    }
    if engine.last_losses is not None:
        cands = server.rule.candidates()
        mean = engine.last_losses.mean(axis=0)
        row["c_star"] = cands[int(np.argmin(mean))]
        row["candidate_mean_losses"] = mean.tolist()
        row["vote_time_s"] = rounds[0]["seconds"] if rounds else None
    return row


def _grids() -> dict[str, list[dict]]:
    """The baselines' tuning grids: those of ``benchmarks/federated.py`` (one definition)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "federated", Path(__file__).with_name("federated.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GRIDS


TUNED = ("adaptive-quantile", "automatic")  # the baselines tuned privately
SELECTION = {"mean_runs": 3.0, "shape": 1.0, "budget_share": 1.0 / 3.0}


def candidate_score(cfg, task, engine, val) -> float:
    """A candidate run's score: its released model's accuracy on the server's validation
    split, once at the end (no per-round evaluation: nothing in these rules reads it)."""
    from dpfit.federated.app import initial_arrays
    from dpfit.federated.batched import drive
    from dpfit.federated.strategy import DPFedAvgServer

    server = DPFedAvgServer(cfg, initial_arrays(task))
    drive(server, engine, cfg.num_clients)
    return engine.evaluate_fn(*val)(server.params)[1]


def tuned_run(method: str, eps: float, seed: int, args, task, engine, val, test) -> dict:
    """Private selection over the method's grid with a third of the budget (Papernot &
    Steinke's random repetition, E[K] = 3, geometric), then the final run on the rest."""
    from dataclasses import replace

    from dpfit.federated.tuning import (
        SelectionConfig,
        plan_tuning,
        private_selection,
        selection_rng,
    )

    grid = _grids()[method]
    selection = SelectionConfig(**SELECTION)
    plan = plan_tuning(server_config(method, eps, seed, args), grid, selection)
    scores: list[dict] = []

    def candidate(point, i: int) -> float:
        # each candidate an independent run: its own (insecure, benchmark) noise stream
        cfg = replace(plan.candidate, insecure_seed=10_000 * (seed + 1) + i, **point)
        score = candidate_score(cfg, task, engine, val)
        scores.append({"hyperparameters": dict(point), "val_accuracy": score})
        return score

    t0, c0 = time.perf_counter(), time.process_time()
    rng = selection_rng(insecure_seed=seed * 1_000 + METHODS.index(method) * 10 + int(eps))
    sel = private_selection(grid, candidate, selection, rng)
    tuning = {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0}
    point = dict(sel.choice) if sel.choice is not None else {}
    final = replace(plan.final, insecure_seed=seed, **point)
    row = one_run(method, eps, seed, args, task, engine, val, test, cfg=final)
    if row["epsilon"] > eps * (1 + 1e-3):
        raise RuntimeError(f"{method} eps={eps}: tuned run spent {row['epsilon']} > target")
    row.update(
        tuned=True,
        hyperparameters=point,
        selection=SELECTION,
        tuning_runs=sel.runs,
        candidate_scores=scores,
        candidate_noise_multiplier=plan.candidate_noise_multiplier,
        tuning_epsilon=plan.tuning_epsilon,
        tuning_seconds=tuning["seconds"],
        tuning_cpu_seconds=tuning["cpu_seconds"],
    )
    return row


def cmd_pilot(args: argparse.Namespace) -> None:
    out = {"rounds": args.rounds, "clients": args.clients, "m": args.clients_per_round, "runs": []}
    path = args.out / "federated_lac_pilot.json"
    if path.exists():
        out = json.loads(path.read_text())
    for opt in args.optimizers:
        if any(r["local_optimizer"] == opt for r in out["runs"]):
            continue
        args.local_optimizer = opt
        task, engine, val, test, _ = setup(args)
        row = one_run(NON_PRIVATE, None, 0, args, task, engine, val, test)
        print(json.dumps({k: row[k] for k in ("local_optimizer", "test_accuracy", "seconds")}))
        out["runs"].append(row)
        path.write_text(json.dumps(out, indent=1))
    (args.out / "federated_lac_pilot.md").write_text(render_pilot(out))
    print(render_pilot(out))


def _corr(a: list[float], b: list[float]) -> float:
    if len(a) < 3 or statistics.pstdev(a) == 0 or statistics.pstdev(b) == 0:
        return math.nan
    return float(np.corrcoef(a, b)[0, 1])


def render_pilot(data: dict) -> str:
    lines = [
        "# Non-private pilot: does the client update norm move with the loss?",
        "",
        f"Batched lora-top MiniLM clients, {data['clients']} IID clients of 10 examples, "
        f"m = {data['m']}, {data['rounds']} rounds, no clipping or noise (fixed rule, "
        "C = 1e6, z = 0), seed 0. Median of the sampled clients' raw update norms per "
        "round (operator-only statistic; this run is not private).",
        "",
        "| optimizer | lr | round 1 norm | last norm | norm last/first | val loss first -> last "
        "| corr(norm, val loss) | test acc |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        norms = [x["median_update_norm"] for x in r["rounds"]]
        losses = [x["val_loss"] for x in r["rounds"]]
        lines.append(
            f"| {r['local_optimizer']} | {r['lr']:g} | {norms[0]:.4g} | {norms[-1]:.4g} | "
            f"{norms[-1] / norms[0]:.2f} | {losses[0]:.3f} -> {losses[-1]:.3f} | "
            f"{_corr(norms, losses):.2f} | {r['test_accuracy']:.3f} |"
        )

    def corr_of(r: dict) -> float:
        c = _corr(
            [x["median_update_norm"] for x in r["rounds"]], [x["val_loss"] for x in r["rounds"]]
        )
        return -math.inf if math.isnan(c) else c

    best = max(data["runs"], key=corr_of)
    lines += [
        "",
        f"Rule: keep the optimizer whose update norm tracks the validation loss most closely "
        f"(highest correlation over the rounds). Kept: **{best['local_optimizer']}** "
        f"(correlation {corr_of(best):.2f}).",
    ]
    lines += ["", "Per round (median update norm / validation loss):", ""]
    lines += ["| round | " + " | ".join(r["local_optimizer"] for r in data["runs"]) + " |"]
    lines += ["|---" * (1 + len(data["runs"])) + "|"]
    for i in range(max(len(r["rounds"]) for r in data["runs"])):
        cells = []
        for r in data["runs"]:
            x = r["rounds"][i] if i < len(r["rounds"]) else None
            cells.append(f"{x['median_update_norm']:.4g} / {x['val_loss']:.3f}" if x else "")
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cmd_splits(args: argparse.Namespace) -> None:
    """The majority-class floor of the test split (a model that learned nothing reaches it)."""
    from dpfit.federated.app import splits

    _, val, test = splits(0)
    data = {}
    for name, split in (("validation", val), ("test", test)):
        counts = [sum(e.label == y for e in split) for y in (0, 1)]
        data[name] = {"examples": len(split), "majority_accuracy": max(counts) / len(split)}
    (args.out / "federated_lac_splits.json").write_text(json.dumps(data, indent=1))
    print(data)


def arm(r: dict) -> str:
    """A row's arm: the rule, or the rule privately tuned."""
    return f"{r['method']} (tuned)" if r.get("tuned") else r["method"]


def check_fixed_clip(args: argparse.Namespace) -> None:
    """--fixed-clip sweeps the fixed rule only, into its own --name (one line if not)."""
    if args.fixed_clip is None:
        return
    if args.command != "run" or args.methods != ["fixed"] or args.tune or args.vote_factors:
        raise SystemExit(
            "--fixed-clip sweeps the fixed rule only: use it with run --methods fixed "
            "(no --tune, no --vote-factors)"
        )
    if any(not c > 0 for c in args.fixed_clip):
        raise SystemExit("--fixed-clip: clip norms must be positive, e.g. --fixed-clip 0.25 0.5")
    if args.name in RENDERED:
        raise SystemExit(
            f"--fixed-clip: give the sweep its own --name (e.g. {args.name}_fixed_sweep), "
            "not a protocol's, so the protocol's per-rule means stay unmixed"
        )


def check_lac_c0(args: argparse.Namespace) -> None:
    """--lac-c0 runs DP-LAC without the vote only, into its own --name (one line if not)."""
    if args.lac_c0 is None:
        return
    if args.command != "run" or args.methods != ["lac"] or args.tune or args.vote_factors \
            or args.fixed_clip is not None:  # fmt: skip
        raise SystemExit(
            "--lac-c0 starts DP-LAC at C0 without the vote: use it with run --methods lac "
            "only (no --tune, --vote-factors or --fixed-clip)"
        )
    if not args.lac_c0 > 0:
        raise SystemExit("--lac-c0: C0 must be positive, e.g. --lac-c0 1")
    if args.name in RENDERED:
        raise SystemExit(
            f"--lac-c0: give the no-vote runs their own --name (e.g. {NOVOTE_NAME}), not a "
            "protocol's, so the protocol's DP-LAC rows stay the voted ones"
        )


def cmd_run(args: argparse.Namespace) -> None:
    path = args.out / f"{args.name}.jsonl"
    done = set()
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            done.add((arm(r), r["epsilon_target"], r["seed"], r["initial_clip"]))
    task, engine, val, test, setup_cost = setup(args)
    with open(args.out / f"{args.name}_setup.jsonl", "a") as f:  # the cache fill's cost
        f.write(json.dumps({"pid": os.getpid(), **setup_cost}) + "\n")
    # seed by seed, so that an interrupted run still has complete pairs; the non-private
    # reference at the first seed only (it has nothing to pair with); --tune: the tuned arms
    # of those baselines instead of the untuned rules
    if args.tune:
        plan = [
            (f"{m} (tuned)", e, s, 1.0)
            for s in args.seeds
            for e in args.epsilons
            for m in args.tune
        ]
    elif args.lac_c0 is not None:  # DP-LAC without its vote, paired with the protocol's
        plan = [(NOVOTE, e, s, args.lac_c0) for s in args.seeds for e in args.epsilons]
    elif args.fixed_clip is not None:  # the fixed rule at other clip norms: no reference
        plan = [
            ("fixed", e, s, c) for s in args.seeds for e in args.epsilons for c in args.fixed_clip
        ]
    else:
        # a variant grid is compared with the default run's rows: no reference of its own
        plan = [] if args.vote_factors else [(NON_PRIVATE, None, args.seeds[0], 1e6)]
        plan += [(m, e, s, 1.0) for s in args.seeds for e in args.epsilons for m in args.methods]
    claims = Path(args.claims) if args.claims else None
    for name, eps, seed, clip in plan:
        if (name, eps, seed, clip) in done or (
            args.fixed_clip is None and any(d[:3] == (name, eps, seed) for d in done)
        ):
            continue
        if args.start_before and time.time() >= args.start_before.timestamp():
            print(f"{args.start_before:%H:%M} UTC passed: no new run started", flush=True)
            break
        if claims is not None:  # several workers share one plan: each run is claimed once
            claims.mkdir(parents=True, exist_ok=True)
            try:
                claim = f"{name}_{eps}_{seed}" + (f"_C{clip:g}" if args.fixed_clip else "")
                os.close(os.open(claims / claim, os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
        hits = engine.memo_hits
        if name.endswith(" (tuned)"):
            method = name.removesuffix(" (tuned)")
            row = tuned_run(method, eps, seed, args, task, engine, val, test)
        else:
            row = one_run(name, eps, seed, args, task, engine, val, test, clip=clip)
        row["load_avg"] = os.getloadavg()[0]
        row["vote_from_memo"] = engine.memo_hits > hits
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(
            f"{name} eps={eps} seed={seed} C_init={clip:g}: test acc {row['test_accuracy']:.4f} "
            f"({row['seconds']:.0f}s, {row['cpu_seconds']:.0f} CPU s)",
            flush=True,
        )


# ------------------------------------------------------------------------------ render


T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}


def interval_verdict(lo: float, hi: float) -> str:
    """A paired 95% interval read against 0: 'above' / 'below' when it excludes 0."""
    return "above" if lo > 0 else "below" if hi < 0 else "not distinguishable from"


def paired_interval(diffs: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval of paired differences (n - 1 degrees of freedom)."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    if n < 2:
        return mean, math.nan, math.nan
    half = T975.get(n - 1, 1.96) * statistics.stdev(diffs) / math.sqrt(n)
    return mean, mean - half, mean + half


def load_floor(out: Path) -> dict | None:
    path = out / "federated_lac_splits.json"
    return json.loads(path.read_text()) if path.exists() else None


def load_runs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


PROTOCOL_SCALE = {"clients": 1000, "clients_per_round": 100, "rounds_requested": 30}


def scale_label(r0: dict) -> str:
    """'protocol scale' only for the issue's N, m and rounds; anything else is labelled
    reduced, so a table can never be read as the full protocol by mistake."""
    full = all(r0[k] == v for k, v in PROTOCOL_SCALE.items())
    return "protocol scale" if full else "REDUCED scale"


def setting_args(r0: dict, name: str) -> str:
    """The run command's options for the recorded setting (scale, local optimizer, name)."""
    return (
        f"--rounds {r0['rounds_requested']} --clients {r0['clients']} "
        f"--clients-per-round {r0['clients_per_round']:g} "
        f"--local-optimizer {r0['local_optimizer']} --lr {r0['lr']:g} --name {name}"
    )


def command_of(runs: list[dict], name: str) -> str:
    """The run commands, rebuilt from the recorded parameters: one line per epsilon with the
    seeds and rules recorded there (an unfinished invocation shows what finished)."""
    r0 = runs[0]
    lines = []
    for e in sorted({r["epsilon_target"] for r in runs if r["epsilon_target"] is not None}):
        for tuned in (False, True):
            at = [r for r in runs if r["epsilon_target"] == e and bool(r.get("tuned")) == tuned]
            if not at:
                continue
            seeds = sorted({r["seed"] for r in at})
            methods = [m for m in METHODS if any(r["method"] == m for r in at)]
            if tuned:
                only = f" --tune {' '.join(methods)}"
            else:
                only = "" if len(methods) == len(METHODS) else f" --methods {' '.join(methods)}"
            lines.append(
                f"python benchmarks/federated_lac.py run --epsilons {e:g} "
                f"--seeds {' '.join(map(str, seeds))}{only} {setting_args(r0, name)}"
            )
    return "\n".join(lines)


def load_setup(out: Path, name: str) -> list[dict]:
    """Each worker process's cache fill (cost only), if recorded."""
    path = out / f"{name}_setup.jsonl"
    return load_runs(path) if path.exists() else []


def cost_line(runs: list[dict], setup: list[dict]) -> str:
    hours = sum(r["seconds"] + r.get("tuning_seconds", 0.0) for r in runs) / 3600
    text = f"{len(runs)} runs, {hours:.2f} h of wall time on a shared 2-core machine, one thread"
    tuned = sum(1 for r in runs if r.get("tuned"))
    if tuned:
        text += f" ({tuned} of them tuned arms, their candidate runs included)"
    if all("cpu_seconds" in r for r in runs):
        cpu = sum(r["cpu_seconds"] + r.get("tuning_cpu_seconds", 0.0) for r in runs)
        fill = sum(s["cpu_seconds"] for s in setup)
        text += (
            f"; CPU time {cpu:.0f} s in the runs + {fill:.0f} s loading/filling the "
            f"frozen-layer cache ({len(setup)} worker starts) = {(cpu + fill) / 3600:.2f} "
            "CPU-hours"
        )
    else:
        text += " (CPU time was not recorded for these runs)"
    return text + "."


PROTOCOL_EPS = (2.0, 8.0)
PROTOCOL_SEEDS = 3


def vote_cpu(r: dict) -> float:
    """CPU seconds of a DP-LAC run's vote: its first round's cumulative CPU (set-up, vote,
    round 1) less one round (the second round's own CPU); about the set-up alone when the
    vote was read back from the memo."""
    c1, c2 = r["rounds"][0]["cpu_seconds"], r["rounds"][1]["cpu_seconds"]
    return 2 * c1 - c2


class CostPart(NamedTuple):
    """One component of the protocol: how many it has, the median CPU seconds of one recorded
    instance (the estimate's price), and what was recorded (count, CPU seconds in all)."""

    what: str
    count: float
    each: float
    recorded: float
    measured: float


def _part(what: str, count: float, values: list[float], each: float | None = None) -> CostPart:
    """A component priced at the median of its recorded values (or at ``each``)."""
    price = each if each is not None else statistics.median(values) if values else 0.0
    return CostPart(what, count, price, len(values), sum(values))


def cost_parts(runs: list[dict]) -> list[CostPart] | None:
    """The components of the whole protocol (both epsilons, three seeds, six untuned rules,
    two tuned arms, the non-private reference), each priced at the median CPU seconds of its
    recorded runs and with the CPU the recorded ones took; every recorded CPU second falls in
    exactly one component. None when a component needed for the price has no recorded run."""
    plain_rules = ("adaptive-quantile", "automatic", "dynamic", "fixed")
    timed = [r for r in runs if "cpu_seconds" in r]
    plain = [r["cpu_seconds"] for r in timed if r["method"] in plain_rules and not r.get("tuned")]
    reference = [r["cpu_seconds"] for r in timed if r["method"] == NON_PRIVATE]
    voted = [r for r in timed if "c_star" in r and len(r["rounds"]) > 1]
    computed = [vote_cpu(r) for r in voted if not r.get("vote_from_memo")]
    read = [vote_cpu(r) for r in voted if r.get("vote_from_memo")]
    tuned = [r for r in timed if r.get("tuned")]
    tried = [r for r in tuned if r["tuning_runs"] > 0]
    if not (plain and voted and computed and tried):
        return None
    cells = len(PROTOCOL_EPS) * PROTOCOL_SEEDS
    votes = 2 * len(PROTOCOL_EPS)  # one computed vote per rule and epsilon, the rest read back
    k = SELECTION["mean_runs"]
    candidate = statistics.median([r["tuning_cpu_seconds"] / r["tuning_runs"] for r in tried])
    return [
        _part("untuned run without a vote (quantile, automatic, dynamic, fixed)", 4 * cells,
              plain),
        _part("non-private reference", 1, reference,
              None if reference else statistics.median(plain)),
        _part("DP-LAC / DP-CLAC run without its vote", 2 * cells,
              [r["cpu_seconds"] - vote_cpu(r) for r in voted]),
        _part("vote computed (once per rule and epsilon with --vote-memo)", votes, computed),
        _part("vote read back from the memo", 2 * cells - votes, read),
        CostPart(f"tuning candidate run (E[K] = {k:g} per arm)", k * 2 * cells, candidate,
                 sum(r["tuning_runs"] for r in tuned),
                 sum(r["tuning_cpu_seconds"] for r in tuned)),
        _part("tuned arm's final run", 2 * cells, [r["cpu_seconds"] for r in tuned]),
    ]  # fmt: skip


def protocol_complete(runs: list[dict]) -> bool:
    """Every rule and tuned arm at both protocol epsilons and three seeds, and the reference."""
    have = {(arm(r), r.get("epsilon_target"), r.get("seed")) for r in runs}
    arms = list(METHODS) + [f"{m} (tuned)" for m in TUNED]
    cells = {(a, e, s) for a in arms for e in PROTOCOL_EPS for s in range(PROTOCOL_SEEDS)}
    return cells <= have and any(r["method"] == NON_PRIVATE for r in runs)


def protocol_cost(runs: list[dict], setup: list[dict] | None = None) -> list[str]:
    """The whole protocol's CPU time: estimated from the medians of the recorded runs (and
    from the less loaded half of them: CPU seconds grow with the machine's load), beside what
    the recorded runs took."""
    parts = cost_parts(runs)
    if parts is None:
        return [
            "Whole-protocol CPU estimate: not made (it needs untuned, DP-LAC and tuned runs "
            "recorded, one DP-LAC run with its vote computed).",
            "",
        ]
    lines = [
        "## The whole protocol's CPU time (estimate from the recorded runs, and as measured)",
        "",
        f"eps {' and '.join(f'{e:g}' for e in PROTOCOL_EPS)}, {PROTOCOL_SEEDS} seeds. "
        "Estimate: each component's count in the protocol times the median CPU seconds of its "
        "recorded runs (a vote: the first round's cumulative CPU less the second round's own). "
        "Measured: the CPU seconds the recorded ones took, each recorded second in one "
        "component.",
        "",
        "| component | count | median CPU s each | estimate CPU-hours | recorded | "
        "measured CPU-hours |",
        "|---|---|---|---|---|---|",
    ]
    for p in parts:
        lines.append(
            f"| {p.what} | {p.count:g} | {p.each:.0f} | {p.count * p.each / 3600:.2f} | "
            f"{p.recorded:g} | {p.measured / 3600:.2f} |"
        )
    total = sum(p.count * p.each for p in parts)
    measured = sum(p.measured for p in parts)
    fill = sum(s["cpu_seconds"] for s in setup or [])
    vote, read = parts[3].each, parts[4].each
    without = total + parts[4].count * (vote - read)
    lines += [
        f"| **total** | | | **{total / 3600:.2f}** | | **{measured / 3600:.2f}** |",
        "",
        f"Without the vote memo (every DP-LAC/DP-CLAC run computing its vote): "
        f"{without / 3600:.2f} CPU-hours estimated.",
        f"Measured: {measured / 3600:.2f} CPU-hours in the recorded runs + "
        f"{fill / 3600:.2f} loading/filling the frozen-layer cache ({len(setup or [])} "
        f"worker starts) = {(measured + fill) / 3600:.2f} CPU-hours, "
        + (
            "the whole protocol (every rule and tuned arm at both epsilons and three seeds, "
            "and the reference)."
            if protocol_complete(runs)
            else "not yet the whole protocol (some of its cells are not recorded)."
        )
        + " A recorded count above the protocol's is work the plan avoids (a vote computed "
        "where the memo would read it back).",
    ]
    loads = [r["load_avg"] for r in runs if "load_avg" in r]
    if loads:
        cut = statistics.median(loads)
        calm = cost_parts([r for r in runs if r.get("load_avg", math.inf) <= cut])
        if calm is not None:
            calm_total = sum(p.count * p.each for p in calm)
            lines.append(
                f"The same estimate from the runs recorded at a load average up to {cut:.1f} "
                f"(the less loaded half): {calm_total / 3600:.2f} CPU-hours."
            )
    return lines + [""]


def lr_rule_line(runs: list[dict], pilot: dict) -> str:
    """The stated lr rule, recomputed: the pilot's SGD lr scaled so that its round-1 median
    update norm would be C_init = 1 (a step from the zero-initialised head scales with lr)."""
    sgd = [r for r in pilot["runs"] if r["local_optimizer"] == "sgd"]
    if not sgd or runs[0]["local_optimizer"] != "sgd":
        return ""
    p = sgd[0]
    norm1 = p["rounds"][0]["median_update_norm"]
    text = (
        f"Learning-rate rule (chosen on neither validation nor test accuracy): the pilot's SGD "
        f"lr {p['lr']:g} x C_init / its round-1 median update norm {norm1:.4g} = "
        f"{p['lr'] / norm1:.3g} at N = {pilot['clients']}, m = {pilot['m']:g}; used: "
        f"{runs[0]['lr']:g}."
    )
    ref = [r for r in runs if r["method"] == NON_PRIVATE and r["rounds"]]
    if ref:
        text += (
            f" At that lr the non-private reference's round-1 median update norm is "
            f"{ref[0]['rounds'][0]['median_update_norm']:.4g} (the step does not scale "
            "linearly with lr)."
        )
    return text


def tuned_line() -> str:
    grids = _grids()
    parts = []
    for m in TUNED:
        key = next(iter(grids[m][0]))
        parts.append(f"{m} {key} in {{{', '.join(f'{g[key]:g}' for g in grids[m])}}}")
    return (
        "the private selection of Papernot & Steinke over "
        + "; ".join(parts)
        + f" with E[K] = {SELECTION['mean_runs']:g} candidate runs (geometric) and "
        f"{SELECTION['budget_share']:.3g} of the budget, each candidate scored by its "
        "validation accuracy, then the final run on the rest; the epsilon of a tuned arm "
        "includes the selection"
    )


def at_floor(score: float, floor: float, examples: int) -> bool:
    """A validation score no better than predicting the majority class (within one example:
    a stratified sample's class counts are rounded)."""
    return score <= floor + 1 / examples


def tuning_section(runs: list[dict], floor: dict | None = None) -> list[str]:
    """Each tuned arm's selection and its cost against DP-LAC's vote at the same epsilon;
    with the validation split's majority-class floor, how many candidates learned nothing
    (when all did, the selection's pick says nothing about the grid)."""
    tuned = [r for r in runs if r.get("tuned")]
    if not tuned:
        return ["No tuned arm was run.", ""]
    votes: dict[float, list[float]] = {}
    for r in runs:
        if r["method"] == "lac" and "c_star" in r and not r.get("vote_from_memo"):
            votes.setdefault(r["epsilon_target"], []).append(vote_cpu(r))
    lines = [
        "## Private tuning of the baselines",
        "",
        "| arm | eps | seed | K | candidates (value: validation accuracy) | chosen | "
        "z candidates | z final | epsilon spent | tuning CPU s | tuning wall s | "
        "tuning CPU / DP-LAC vote CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in tuned:
        key = next(iter(r["hyperparameters"]), None)
        cands = ", ".join(
            f"{c['hyperparameters'][key]:g}: {c['val_accuracy']:.3f}" for c in r["candidate_scores"]
        )
        chosen = f"{key} = {r['hyperparameters'][key]:g}" if key else "default (K = 0)"
        vote = votes.get(r["epsilon_target"])
        ratio = f"{r['tuning_cpu_seconds'] / statistics.median(vote):.1f}" if vote else "-"
        lines.append(
            f"| {arm(r)} | {r['epsilon_target']:g} | {r['seed']} | {r['tuning_runs']} | {cands} "
            f"| {chosen} | {r['candidate_noise_multiplier']:.3f} | {r['noise_multiplier']:.3f} "
            f"| {r['epsilon']:.3f} | {r['tuning_cpu_seconds']:.0f} | "
            f"{r['tuning_seconds']:.0f} | {ratio} |"
        )
    lines.append("")
    for e in sorted(votes):
        for m in TUNED:
            cpu = [r["tuning_cpu_seconds"] for r in tuned if
                   (r["method"], r["epsilon_target"]) == (m, e)]  # fmt: skip
            if cpu:
                lines.append(
                    f"- {m} (tuned), eps {e:g}: median tuning CPU {statistics.median(cpu):.0f} s "
                    f"= {statistics.median(cpu) / statistics.median(votes[e]):.1f} x DP-LAC's "
                    f"vote ({statistics.median(votes[e]):.0f} s; n={len(cpu)} tuned seeds)"
                )
    if floor:
        lines.append("")
        vfloor = floor["validation"]["majority_accuracy"]
        for e in sorted({r["epsilon_target"] for r in tuned}):
            for m in TUNED:
                rows = [r for r in tuned if (r["method"], r["epsilon_target"]) == (m, e)]
                scores = [c["val_accuracy"] for r in rows for c in r["candidate_scores"]]
                if not scores:
                    continue
                low = sum(at_floor(x, vfloor, r["val_examples"]) for x in scores)
                lines.append(
                    f"- {m} (tuned), eps {e:g}: {low} of {len(scores)} candidate runs score at or "
                    f"below the validation split's majority-class floor ({vfloor:.4f}), i.e. learned "
                    "nothing the score can see"
                    + (" (every one: the pick is arbitrary)" if low == len(scores) else "")
                )
    lines += [
        "",
        "DP-LAC vote CPU: the median CPU seconds of the vote (its first round's cumulative "
        "CPU less the second round's own) of the DP-LAC runs at that epsilon whose vote was "
        "computed (not read back). K, the candidates tried and their "
        "scores are operator-only (the selection's bound does not cover releasing them); they "
        "are shown because these runs are a benchmark with insecure seeds.",
        "",
    ]
    return lines


SWEEP_NAME, SWEEP_BASE = "federated_lac_fixed_sweep", "federated_lac_full"
NOVOTE_NAME = "federated_lac_novote"
RETIMED_NAME = "federated_lac_retimed"  # protocol runs re-timed with a later engine
ROUND_TIME = Path(__file__).parent / "results" / "federated_round_time.json"


def engine_ratio(path: Path = ROUND_TIME) -> dict | None:
    """The batched engine's CPU per protocol round against its previous version, measured
    side by side (benchmarks/federated_round_time.py --against-ref), if recorded."""
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("side_by_side")


def cell_key(r: dict) -> tuple:
    return (arm(r), r["epsilon_target"], r["seed"], r["initial_clip"])


def retimed_cost(
    runs: list[dict], retimed: Sequence[dict], novote: Sequence[dict], ratio: dict | None
) -> list[str]:
    """The whole protocol's CPU estimate with the current engine: each component priced at
    the median CPU seconds of its re-timed runs (DP-LAC runs without their vote also from the
    no-vote arm, the same per-round work), a component with none re-timed at its recorded
    median times the engine's side-by-side round ratio; beside the recorded runs' accuracy
    at the same cells."""
    parts = cost_parts(runs)
    if not retimed or parts is None:
        return []
    plain_rules = ("adaptive-quantile", "automatic", "dynamic", "fixed")
    plain = [r["cpu_seconds"] for r in retimed if r["method"] in plain_rules and not r.get("tuned")]
    reference = [r["cpu_seconds"] for r in retimed if r["method"] == NON_PRIVATE]
    tuned = [r for r in retimed if r.get("tuned")]
    candidates = [r["tuning_cpu_seconds"] / r["tuning_runs"] for r in tuned if r["tuning_runs"]]
    finals = [r["cpu_seconds"] for r in tuned]
    voted = [r for r in retimed if "c_star" in r and len(r["rounds"]) > 1]
    lac_runs = [r["cpu_seconds"] - vote_cpu(r) for r in voted]
    lac_runs += [r["cpu_seconds"] for r in novote]
    votes = [vote_cpu(r) for r in voted if not r.get("vote_from_memo")]
    scale = ratio["ratio"] if ratio else None
    priced = [plain, reference, lac_runs, votes, None, candidates, finals]
    rows, total = [], 0.0
    for part, new in zip(parts, priced, strict=True):
        if new:
            each, source = statistics.median(new), f"re-timed (n={len(new)})"
        elif new is None:  # reading the memo back: no engine work
            each, source = part.each, "recorded (no engine work)"
        elif scale is not None:
            each, source = part.each * scale, f"recorded x {scale:.2f} (not re-timed)"
        else:
            return []
        total += part.count * each
        rows.append(
            f"| {part.what} | {part.count:g} | {part.each:.0f} | {each:.0f} | {source} | "
            f"{part.count * each / 3600:.2f} |"
        )
    recorded = sum(p.count * p.each for p in parts)
    lines = [
        "### Re-estimated with the current engine (estimate from re-timed runs)",
        "",
        "The batched engine now caches the top layer's frozen q/k/v products per text and "
        "groups examples by exact length (no padding)"
        + (
            f"; side by side, a protocol round takes {ratio['ratio']:.2f} x the previous "
            f"engine's CPU (federated_round_time.md, `{ratio['command']}`)"
            if ratio
            else ""
        )
        + f". Re-timed: {len(retimed)} protocol runs ({RETIMED_NAME}.jsonl), one thread, "
        "vote computed (no memo):",
        "",
        "```",
        command_of(list(retimed), RETIMED_NAME),
        "```",
        "",
        "| component | count | recorded median CPU s | now CPU s each | priced from | "
        "estimate CPU-hours |",
        "|---|---|---|---|---|---|",
        *rows,
        f"| **total** | | | | | **{total / 3600:.2f}** |",
        "",
        f"Estimate with the current engine: {total / 3600:.2f} CPU-hours for the whole "
        f"protocol, against {recorded / 3600:.2f} estimated and "
        f"{(sum(p.measured for p in parts)) / 3600:.2f} measured with the previous one (above). "
        "DP-LAC runs without their vote are priced also from the no-vote arm "
        f"({NOVOTE_NAME}.jsonl, {len(novote)} runs). CPU seconds grow with the machine's "
        "load (load averages below), so a re-timed run's saving is the engine's and the "
        "load's together; the engine's alone is the side-by-side ratio"
        + (
            f": the previous estimate x {scale:.2f} = {recorded * scale / 3600:.2f} CPU-hours "
            "(the previous runs' load kept)."
            if scale is not None
            else "."
        ),
        "",
        "Re-timed runs against the recorded ones at the same cell (the same seed: client "
        "sampling, noise and data order are the same streams, so a difference is the "
        "engine's float rounding, grown over 30 rounds):",
        "",
        "| arm | eps | seed | recorded accuracy | re-timed accuracy | test loss difference "
        "| recorded CPU s (load) | re-timed CPU s (load) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by = {cell_key(r): r for r in runs}
    diffs = []
    for r in retimed:
        old = by.get(cell_key(r))
        if old is None:
            continue
        diffs.append(abs(r["test_accuracy"] - old["test_accuracy"]))
        e = "-" if r["epsilon_target"] is None else f"{r['epsilon_target']:g}"
        lines.append(
            f"| {arm(r)} | {e} | {r['seed']} | {old['test_accuracy']:.4f} | "
            f"{r['test_accuracy']:.4f} | {r['test_loss'] - old['test_loss']:+.2e} | "
            f"{old['cpu_seconds']:.0f} ({old.get('load_avg', math.nan):.1f}) | "
            f"{r['cpu_seconds']:.0f} ({r.get('load_avg', math.nan):.1f}) |"
        )
    if diffs:
        lines += [
            "",
            f"Largest test-accuracy difference over the {len(diffs)} re-timed runs: "
            f"{max(diffs):.4f} ({round(max(diffs) * runs[0]['test_examples'])} of "
            f"{runs[0]['test_examples']} test examples).",
        ]
    return lines + [""]


def novote_section(runs: list[dict], novote: Sequence[dict]) -> list[str]:
    """DP-LAC (the protocol's, with its vote) against DP-LAC started at C0 without the vote
    (all of epsilon to the rounds), and that against the fixed rule at the same C, paired by
    epsilon and seed (the same client sampling and noise streams)."""
    if not novote:
        return []
    r0 = novote[0]
    c0 = r0["initial_clip"]
    by = {(arm(r), r["epsilon_target"], r["seed"]): r for r in runs}
    eps_list = sorted({r["epsilon_target"] for r in novote})
    seeds = sorted({r["seed"] for r in novote})
    lines = [
        f"## DP-LAC without its vote (C0 = {c0:g}: all of epsilon to the rounds)",
        "",
        f"DP-LAC started at C0 = {c0:g} x C_init with no vote (rule `{NOVOTE}`: the same "
        "validation-loss shrink from round 1 on, v_0 recorded at the start), so the rounds get "
        "the vote's share of the budget too (a smaller z); recorded in this protocol's setting "
        f"at the same seeds ({NOVOTE_NAME}.jsonl), so each run pairs with this protocol's "
        "DP-LAC and fixed-rule runs at its epsilon and seed:",
        "",
        "```",
        f"python benchmarks/federated_lac.py run --methods lac --lac-c0 {c0:g} --epsilons "
        f"{' '.join(f'{e:g}' for e in sorted(eps_list, reverse=True))} --seeds "
        f"{' '.join(map(str, seeds))} {setting_args(r0, NOVOTE_NAME)}",
        "```",
        "",
        f"| eps | seed | DP-LAC C_hist | z DP-LAC | z no vote | epsilon no vote | DP-LAC "
        f"accuracy | no vote accuracy | fixed C = {c0:g} accuracy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    diffs: dict[str, dict[float, list[float]]] = {"vote": {}, "shrink": {}}
    z_up: dict[float, float] = {}  # how much more noise DP-LAC's rounds carry, per epsilon
    same_c0 = 0
    paired = 0
    for r in sorted(novote, key=lambda r: (r["epsilon_target"], r["seed"])):
        e, s = r["epsilon_target"], r["seed"]
        lac, fixed = by.get(("lac", e, s)), by.get(("fixed", e, s))
        if fixed is not None and fixed["initial_clip"] != c0:
            fixed = None
        if lac is not None:
            paired += 1
            same_c0 += lac["initial_clip"] == c0
            diffs["vote"].setdefault(e, []).append(lac["test_accuracy"] - r["test_accuracy"])
            z_up[e] = lac["noise_multiplier"] / r["noise_multiplier"] - 1
        if fixed is not None:
            diffs["shrink"].setdefault(e, []).append(r["test_accuracy"] - fixed["test_accuracy"])
        lines.append(
            f"| {e:g} | {s} | "
            + (f"{lac['initial_clip']:g} | {lac['noise_multiplier']:.3f}" if lac else "- | -")
            + f" | {r['noise_multiplier']:.3f} | {r['epsilon']:.3f} | "
            + (f"{lac['test_accuracy']:.4f}" if lac else "not run")
            + f" | {r['test_accuracy']:.4f} | "
            + (f"{fixed['test_accuracy']:.4f}" if fixed else "not run")
            + " |"
        )
    lines += ["", "Paired by seed (95% t-interval):", ""]
    verdicts: dict[str, dict[float, str]] = {"vote": {}, "shrink": {}}
    titles = {
        "vote": "DP-LAC (vote) minus no vote",
        "shrink": f"no vote minus fixed C = {c0:g}",
    }
    for e in eps_list:
        for key in ("vote", "shrink"):
            d = diffs[key].get(e, [])
            if len(d) < 2:
                lines.append(f"- eps {e:g}, {titles[key]}: fewer than two paired seeds")
                continue
            mean, lo, hi = paired_interval(d)
            verdicts[key][e] = f"{mean:+.4f} [{lo:+.4f}, {hi:+.4f}], {interval_verdict(lo, hi)} 0"
            lines.append(
                f"- eps {e:g}, {titles[key]}: {mean:+.4f} [{lo:+.4f}, {hi:+.4f}] "
                f"(n={len(d)}): {interval_verdict(lo, hi)} 0"
            )
    lines.append("")
    if verdicts["vote"] or verdicts["shrink"]:
        measured = "; ".join(
            f"eps {e:g}: vote minus no vote {verdicts['vote'][e]}, no vote minus fixed "
            f"{verdicts['shrink'][e]}"
            for e in eps_list
            if e in verdicts["vote"] and e in verdicts["shrink"]
        )
        lines += [
            f"What this separates: the vote picked C0 = {c0:g} in {same_c0} of the {paired} "
            f"paired DP-LAC runs, so there DP-LAC minus the no-vote arm is the price of the "
            "vote's budget share alone (same C0, more noise on every round), and the no-vote "
            f"arm minus fixed C = {c0:g} is what the per-round shrink does alone (same budget, "
            f"same C0). In noise, the vote's share makes DP-LAC's rounds' z "
            + ", ".join(f"{z_up[e]:+.1%} (eps {e:g})" for e in sorted(z_up))
            + f" against the no-vote arm's. Measured: {measured} (a positive difference: the "
            "first arm is better).",
            "",
        ]
    return lines


SETTING = ("rounds_requested", "clients", "clients_per_round", "local_optimizer", "lr",
           "val_examples", "test_examples")  # fmt: skip


def paired_sweep(runs: list[dict], sweep: Sequence[dict]) -> list[dict]:
    """The sweep's fixed runs recorded in the protocol's setting: at the same epsilon and
    seed they share its client sampling and noise streams (insecure_seed = seed), so they
    pair with its runs; a sweep row in another setting is left out."""
    if not runs:
        return []
    return [
        x for x in sweep if arm(x) == "fixed" and all(x.get(k) == runs[0].get(k) for k in SETTING)
    ]


def c_star_section(runs: list[dict], sweep: Sequence[dict] = ()) -> list[str]:
    """DP-LAC's C_hist against C*, the best fixed clip norm in hindsight (highest test
    accuracy) among the fixed-rule runs recorded at the same epsilon and seed, the protocol's
    (C = 1) and the fixed-clip sweep's (``sweep``, other C); paired by seed."""
    lac = sorted(
        (r for r in runs if arm(r) == "lac" and "c_star" in r),
        key=lambda r: (r["epsilon_target"], r["seed"]),
    )
    swept = paired_sweep(runs, sweep)
    fixed_runs = [r for r in runs if arm(r) == "fixed" and r["epsilon_target"] is not None]
    fixed_runs += swept
    if not lac or not fixed_runs:
        return []
    from dpfit.federated.clipping import ClipConfig

    factors = lac[0].get("vote_factors", ClipConfig.vote_factors)  # older rows: the default
    grid = ", ".join(f"{f:g}" for f in factors)
    per_eps = []
    covered = []
    for e in sorted({r["epsilon_target"] for r in fixed_runs}):
        at = [r for r in fixed_runs if r["epsilon_target"] == e]
        norms = sorted({r["initial_clip"] for r in at})
        cells = []
        for c in norms:
            seeds = sorted({r["seed"] for r in at if r["initial_clip"] == c})
            cells.append(f"{c:g} (seed{'s' if len(seeds) > 1 else ''} {' '.join(map(str, seeds))})")
        per_eps.append(f"eps {e:g}: {', '.join(cells)}")
        c_init = 1.0  # the protocol's C_init (server_config)
        if all(any(math.isclose(f * c_init, c) for c in norms) for f in factors):
            covered.append(f"{e:g}")
    measured = ", ".join(f"{c:g}" for c in sorted({r["initial_clip"] for r in fixed_runs}))
    if covered:
        scope = (
            f"At eps {', '.join(covered)} the measured norms cover the vote's candidates "
            f"({{{grid}}} x C_init), so there C* is the best of them; elsewhere C* is the best "
            "of the measured norms only, and C_hist = C* says the vote picked the one measured, "
            "not that it is optimal."
        )
    else:
        scope = (
            f"C* is the best of those only, not of the vote's candidates ({{{grid}}} x C_init; "
            "no sweep of the fixed rule over them was recorded): C_hist = C* below says the "
            "vote picked the one fixed clip norm that was measured, not that it is optimal."
        )
    lines = [
        "## DP-LAC's C_hist against C*, the best fixed clip norm in hindsight",
        "",
        f"C* = the fixed rule's clip norm with the highest test accuracy among the fixed-rule "
        f"runs recorded at the same epsilon and seed. Fixed clip norms recorded: {{{measured}}}"
        f"; measured per epsilon: {'; '.join(per_eps)}. {scope}",
    ]
    if swept:
        sw_eps = " ".join(f"{e:g}" for e in sorted({r["epsilon_target"] for r in swept}))
        sw_seeds = " ".join(str(s) for s in sorted({r["seed"] for r in swept}))
        sw_norms = " ".join(f"{c:g}" for c in sorted({r["initial_clip"] for r in swept}))
        lines += [
            "",
            f"The norms other than C = 1 come from the fixed-rule sweep ({SWEEP_NAME}.jsonl), "
            "recorded in this protocol's setting at the same seeds, so each is paired with "
            "this protocol's runs at a seed (the same client sampling and noise streams):",
            "",
            "```",
            f"python benchmarks/federated_lac.py run --methods fixed --fixed-clip {sw_norms} "
            f"--epsilons {sw_eps} --seeds {sw_seeds} {setting_args(swept[0], SWEEP_NAME)}",
            "```",
        ]
    lines += [
        "",
        "| eps | seed | C_hist | C_loss | C* (of recorded) | DP-LAC accuracy | fixed C* "
        "accuracy | DP-LAC minus fixed C* |",
        "|---|---|---|---|---|---|---|---|",
    ]
    diffs: dict[float, list[float]] = {}
    same = 0
    for r in lac:
        e, s = r["epsilon_target"], r["seed"]
        at = (e, s)
        fixed = [x for x in fixed_runs if (x["epsilon_target"], x["seed"]) == at]
        if not fixed:
            lines.append(
                f"| {e:g} | {s} | {r['initial_clip']:g} | {r['c_star']:g} | not run | "
                f"{r['test_accuracy']:.4f} | not run | - |"
            )
            continue
        best = max(fixed, key=lambda x: x["test_accuracy"])
        d = r["test_accuracy"] - best["test_accuracy"]
        same += r["initial_clip"] == best["initial_clip"]
        diffs.setdefault(e, []).append(d)
        lines.append(
            f"| {e:g} | {s} | {r['initial_clip']:g} | {r['c_star']:g} | "
            f"{best['initial_clip']:g} | {r['test_accuracy']:.4f} | "
            f"{best['test_accuracy']:.4f} | {d:+.4f} |"
        )
    paired = sum(map(len, diffs.values()))
    lines += ["", f"C_hist = C* in {same} of the {paired} DP-LAC runs with a fixed run."]
    for e in sorted({r["epsilon_target"] for r in fixed_runs}):
        at = [r for r in fixed_runs if r["epsilon_target"] == e]
        norms = sorted({r["initial_clip"] for r in at})
        if len(norms) > 1:
            means = ", ".join(
                f"C = {c:g}: {np.mean([r['test_accuracy'] for r in at if r['initial_clip'] == c]):.4f}"
                for c in norms
            )
            lines.append(f"- eps {e:g}: fixed-rule test accuracy by clip norm (seed mean): {means}")
    for e, d in sorted(diffs.items()):
        if len(d) < 2:
            lines.append(f"- eps {e:g}: DP-LAC minus fixed C*: {d[0]:+.4f} (one seed)")
            continue
        mean, lo, hi = paired_interval(d)
        lines.append(
            f"- eps {e:g}: DP-LAC minus fixed C*, paired by seed: {mean:+.4f} "
            f"[{lo:+.4f}, {hi:+.4f}] (n={len(d)}): {interval_verdict(lo, hi)} it"
        )
    return lines + [""]


def render(
    runs: list[dict],
    name: str,
    floor: dict | None = None,
    setup: list[dict] | None = None,
    pilot: dict | None = None,
    sweep: Sequence[dict] = (),
    novote: Sequence[dict] = (),
    retimed: Sequence[dict] = (),
    ratio: dict | None = None,
    first_run: Sequence[dict] = (),
) -> str:
    r0 = runs[0]
    eps_list = sorted({r["epsilon_target"] for r in runs if r["epsilon_target"] is not None})
    seeds = sorted({r["seed"] for r in runs})
    by = {(arm(r), r["epsilon_target"], r["seed"]): r for r in runs}
    # every rule, and the tuned arms: a cell that was not run says so
    methods = list(METHODS) + [f"{m} (tuned)" for m in TUNED]
    lines = [
        f"# DP-LAC against the clip-rule baselines on fine-tuned clients ({scale_label(r0)}: "
        f"N = {r0['clients']}, m = {r0['clients_per_round']:g}, {r0['rounds_requested']} rounds)",
        "",
        f"Batched lora-top MiniLM clients (LoRA r=4 on the top layer's q, v + its biases + "
        f"the head), local {r0['local_optimizer']} lr {r0['lr']:g}, 2 local epochs, batch 16; "
        f"N = {r0['clients']} IID clients of 10 examples, m = {r0['clients_per_round']:g} "
        f"expected a round (Poisson), {r0['rounds_requested']} rounds; every rule untuned "
        f"(C_init = 1); the '(tuned)' arms: quantile and automatic privately tuned by "
        f"{tuned_line()}; test accuracy on the full test split ({r0['test_examples']} "
        f"examples), the server's public validation {r0['val_examples']} examples (stratified "
        "sample of the validation split). "
        f"Seeds {', '.join(map(str, seeds))} (paired: the same client sampling and noise "
        f"streams for every rule at a seed). {cost_line(runs, setup or [])}",
        "",
        "```",
        command_of(runs, name),
        "```",
        "",
        *([lr_rule_line(runs, pilot), ""] if pilot and lr_rule_line(runs, pilot) else []),
        "## Test accuracy (mean and sd over seeds)",
        "",
        *(
            [
                "Majority-class accuracy of the test split (what a model that learned nothing "
                f"reaches): {floor['test']['majority_accuracy']:.4f}.",
                "",
            ]
            if floor
            else []
        ),
        "| rule | " + " | ".join(f"eps {e:g}" for e in eps_list) + " |",
        "|---" * (1 + len(eps_list)) + "|",
    ]

    def accs(m: str, e: float | None) -> list[float]:
        return [by[(m, e, s)]["test_accuracy"] for s in seeds if (m, e, s) in by]

    def cell(xs: list[float]) -> str:
        if not xs:
            return "not run"
        if len(xs) == 1:  # one seed: no spread to show
            return f"{xs[0]:.4f} (n=1)"
        return f"{statistics.fmean(xs):.4f} ± {statistics.stdev(xs):.4f} (n={len(xs)})"

    for m in methods:
        lines.append(f"| {m} | " + " | ".join(cell(accs(m, e)) for e in eps_list) + " |")
    npv = accs(NON_PRIVATE, None)
    if npv:
        lines.append(f"| non-private | {cell(npv)} |" + " |" * (len(eps_list) - 1))
    lines += [
        "",
        "## DP-LAC minus each baseline, paired by seed (95% t-interval)",
        "",
        "| baseline | " + " | ".join(f"eps {e:g}" for e in eps_list) + " |",
        "|---" * (1 + len(eps_list)) + "|",
    ]
    verdicts: dict[float, list[str]] = {e: [] for e in eps_list}
    for m in methods:
        if m == "lac":
            continue
        cells = []
        for e in eps_list:
            pairs = [s for s in seeds if ("lac", e, s) in by and (m, e, s) in by]
            if not pairs:
                cells.append("not run")
                verdicts[e].append(f"not compared with {m} (not run)")
                continue
            d = [by[("lac", e, s)]["test_accuracy"] - by[(m, e, s)]["test_accuracy"] for s in pairs]
            mean, lo, hi = paired_interval(d)
            if len(d) < 2:  # one pair: no interval
                cells.append(f"{mean:+.4f} (n=1)")
            else:
                cells.append(f"{mean:+.4f} [{lo:+.4f}, {hi:+.4f}] (n={len(d)})")
            if len(d) < 2:
                verdicts[e].append(f"without an interval against {m} (one seed)")
            else:
                verdicts[e].append(f"{interval_verdict(lo, hi)} {m}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    for e in eps_list:  # the verdict of each 95% interval: excludes 0 (above/below) or not
        lines.append(f"- At eps {e:g}, DP-LAC is " + "; ".join(verdicts[e]) + ".")
    lines += [
        "",
        "above / below: the paired 95% interval excludes 0; not distinguishable: it holds 0.",
        "",
    ]
    lines += [
        "## DP-LAC's vote: C_hist against the vote's own optimum",
        "",
        "C_hist = the noised histogram's pick; C_loss = the candidate with the lowest mean "
        "candidate loss over all clients (the vote's objective, recomputed non-privately by the "
        "benchmark). C* (the best fixed clip norm) is in the next section.",
        "",
        "| rule | eps | seed | sigma_h | noised counts | C_hist | C_loss | vote | vote + round 1 "
        "CPU s | run CPU s | vote wall s | run wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        if "c_star" in r:
            counts = ", ".join(f"{c:.0f}" for c in r["vote_counts"])
            cpu = (
                f"{r['rounds'][0]['cpu_seconds']:.0f} | {r['cpu_seconds']:.0f}"
                if "cpu_seconds" in r
                else "- | -"
            )
            memo = "read back" if r.get("vote_from_memo") else "computed"
            lines.append(
                f"| {r['method']} | {r['epsilon_target']:g} | {r['seed']} | "
                f"{r['vote_noise_std']:.2f} | {counts} | {r['initial_clip']:g} | "
                f"{r['c_star']:g} | {memo} | {cpu} | {r['vote_time_s']:.0f} | "
                f"{r['seconds']:.0f} |"
            )
    lines += [
        "",
        "vote: from the run's start to the end of round 1, i.e. the vote (all N clients train "
        "once and score three candidates) plus one round; compare with the whole run's time. "
        "'read back': the vote's loss matrix came from the vote memo (`--vote-memo`), kept "
        "when the same query (same epsilon, any seed) was computed before, so that run's vote "
        "cost almost nothing; its outcome is the computed one's (tested). "
        "CPU seconds are the process's own; wall seconds also count waiting for the shared "
        "cores.",
        "",
        *c_star_section(runs, sweep),
        *novote_section(runs, novote),
        *tuning_section(runs, floor),
        *protocol_cost(runs, setup),
        *retimed_cost(runs, retimed, novote, ratio),
        *reproduction(runs, first_run),
        f"## Clip norm, median client update norm and validation loss (seed {seeds[0]})",
        "",
        "| rule | eps | C_t round 1 -> last | norm round 1 -> last | val loss round 1 -> last "
        "| corr(norm, loss) |",
        "|---|---|---|---|---|---|",
    ]
    for r in runs:
        if r["seed"] != seeds[0] or not r["rounds"]:
            continue
        n = [x["median_update_norm"] for x in r["rounds"]]
        v = [x["val_loss"] for x in r["rounds"]]
        c = [x["clip_norm"] for x in r["rounds"]]
        eps = "-" if r["epsilon_target"] is None else f"{r['epsilon_target']:g}"
        clip = "-" if r["method"] == NON_PRIVATE else f"{c[0]:.4g} -> {c[-1]:.4g}"
        lines.append(
            f"| {arm(r)} | {eps} | {clip} | {n[0]:.4g} -> {n[-1]:.4g} | "
            f"{v[0]:.3f} -> {v[-1]:.3f} | {_corr(n, v):.2f} |"
        )
    lines += ["", f"![C_t and update norm per rule and tuned arm]({name}.png)", ""]
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    """C_t and the median client update norm per round of each rule and tuned arm, one seed
    (the first), each epsilon."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps_list = sorted({r["epsilon_target"] for r in runs if r["epsilon_target"] is not None})
    seed = min(r["seed"] for r in runs)
    reference = [r for r in runs if r["method"] == NON_PRIVATE and r["seed"] == seed]
    fig, axes = plt.subplots(
        2, len(eps_list), figsize=(5.5 * len(eps_list), 6.4), squeeze=False, sharex=True
    )
    for col, e in enumerate(eps_list):
        # one colour per rule in every panel; a tuned arm dotted in its rule's colour
        arms = [(m, m) for m in METHODS] + [(f"{m} (tuned)", m) for m in TUNED]
        for name, m in arms:
            rows = [r for r in runs if arm(r) == name and r["epsilon_target"] == e]
            rows = [r for r in rows if r["seed"] == seed and r["rounds"]]
            if not rows:
                continue
            x = [p["round"] for p in rows[0]["rounds"]]
            style = {"label": name, "color": f"C{METHODS.index(m)}"}
            if name != m:
                style["linestyle"] = ":"
            axes[0, col].plot(x, [p["clip_norm"] for p in rows[0]["rounds"]], **style)
            axes[1, col].plot(x, [p["median_update_norm"] for p in rows[0]["rounds"]], **style)
        for r in reference:
            x = [p["round"] for p in r["rounds"]]
            y = [p["median_update_norm"] for p in r["rounds"]]
            axes[1, col].plot(x, y, "k--", label=NON_PRIVATE)
        axes[0, col].set_yscale("log")
        axes[0, col].set_ylabel("C_t")
        axes[0, col].set_title(f"eps {e:g}, seed {seed}")
        axes[1, col].set_yscale("log")
        axes[1, col].set_ylabel("median client update norm")
        axes[1, col].set_xlabel("round")
        axes[0, col].legend(fontsize=7)
        axes[1, col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# the page that quotes every protocol in words (moved out of docs/federated.md, which links it);
# it sits beside the plots, so their paths need no rewriting
DOCS = RESULTS / "federated_history.md"
MARKERS = ("<!-- federated_lac:begin -->", "<!-- federated_lac:end -->")


def docs_section(pilot_md: str, protocols: Sequence[tuple[str, str]]) -> str:
    """The history page's section: the pilot, then each (name, rendering) of the protocol,
    titles one level down."""
    out = []
    for text in (pilot_md, *(md for _, md in protocols)):
        for line in text.splitlines():
            if line.startswith("#"):
                line = "#" + line
            out.append(line)
        out.append("")
    return "\n".join(out).strip()


def write_into_docs(section: str, docs: Path) -> None:
    write_between_markers(docs, MARKERS, section)


GRID_NAME, GRID_BASE = "federated_lac_grid", "federated_lac_full"
RERUN_NAME, RERUN_BASE = "federated_lac_rerun", "federated_lac_full"


def reproduction(runs: Sequence[dict], first: Sequence[dict]) -> list[str]:
    """The whole protocol run again on a later engine against its first run, cell by cell
    (same rule, epsilon and seed: the same client sampling and noise streams): what the engine
    changed in the results, beyond float rounding, and in each run's CPU time."""
    by = {(arm(r), r["epsilon_target"], r["seed"]): r for r in first}
    pairs = [(r, by[k]) for r in runs if (k := (arm(r), r["epsilon_target"], r["seed"])) in by]
    if not pairs:
        return []
    diffs = [a["test_accuracy"] - b["test_accuracy"] for a, b in pairs]
    same = sum(1 for d in diffs if abs(d) < 0.5 / pairs[0][0]["test_examples"])
    c0 = [(a, b) for a, b in pairs if "c_star" in a and a["rounds"] and b["rounds"]]
    c0_same = sum(1 for a, b in c0 if a["rounds"][0]["clip_norm"] == b["rounds"][0]["clip_norm"])
    plain = [
        (a, b) for a, b in pairs
        if not a.get("tuned") and "c_star" not in a and a["method"] != NON_PRIVATE
    ]  # fmt: skip
    lines = [
        f"## This run against the protocol's first run ({RERUN_BASE}.jsonl)",
        "",
        f"{len(pairs)} cells (rule or tuned arm, epsilon, seed) are in both runs. Test "
        f"accuracy, this run minus the first: the same number of correct test predictions in "
        f"{same} of "
        f"{len(pairs)}; largest difference {max(diffs, key=abs):+.4f}, mean "
        f"{statistics.fmean(diffs):+.4f} (a difference comes from float rounding in the "
        "changed engine, grown over 30 noisy rounds, not from another sampling or noise "
        "draw).",
    ]
    if c0:
        lines[-1] += f" DP-LAC / DP-CLAC started from the same C_0 in {c0_same} of {len(c0)}."
    if plain:
        ratio = statistics.median(a["cpu_seconds"] / b["cpu_seconds"] for a, b in plain)
        load_a = statistics.median(a.get("load_avg", math.nan) for a, _ in plain)
        load_b = statistics.median(b.get("load_avg", math.nan) for _, b in plain)
        lines[-1] += (
            f" CPU seconds of an untuned run without a vote, this run / the first, median over "
            f"{len(plain)} pairs: {ratio:.2f} (median load average at the runs' ends "
            f"{load_a:.1f} here, {load_b:.1f} in the first run: CPU seconds grow with load on "
            "this shared machine)."
        )
    return lines + [""]


def render_grid(grid: list[dict], base: list[dict], name: str, base_name: str) -> str:
    """DP-LAC with another vote grid against the protocol's DP-LAC (the paper's grid) and its
    fixed rule, paired by seed: the same client sampling and noise streams at a seed."""
    factors = grid[0]["vote_factors"]
    label = f"DP-LAC over {{{', '.join(f'{f:g}' for f in factors)}}} x C_init"
    by = {(arm(r), r["epsilon_target"], r["seed"]): r for r in base}
    epsilons = " ".join(f"{e:g}" for e in sorted({r["epsilon_target"] for r in grid}))
    seeds = " ".join(str(s) for s in sorted({r["seed"] for r in grid}))
    grid_args = " ".join(f"{f:g}" for f in factors)
    cmd = (
        f"python benchmarks/federated_lac.py run --epsilons {epsilons} --seeds {seeds} "
        f"--methods lac --vote-factors {grid_args} {setting_args(grid[0], name)}"
    )
    lines = [
        f"# {label}, against the protocol's rules ({scale_label(grid[0])})",
        "",
        f"The protocol's setting ({base_name}.md), DP-LAC's vote over a grid that reaches above "
        "C_init = 1, because with the paper's grid the vote picked its largest candidate, "
        "C_init itself, at every seed. The other rows are the protocol's runs at the same "
        "seeds (paired: the same client sampling and noise streams).",
        "",
        "```",
        cmd,
        "```",
        "",
        "| eps | seed | noised counts | C_hist | C_loss | final C | test accuracy | DP-LAC "
        "(paper's grid) | fixed C = 1 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(grid, key=lambda r: (r["epsilon_target"], r["seed"])):
        e, s = r["epsilon_target"], r["seed"]
        lac, fixed = by.get(("lac", e, s)), by.get(("fixed", e, s))
        counts = ", ".join(f"{c:.0f}" for c in r["vote_counts"])
        lines.append(
            f"| {e:g} | {s} | {counts} | {r['initial_clip']:.4g} | {r.get('c_star', math.nan):.4g} "
            f"| {r['rounds'][-1]['clip_norm']:.4g} | {r['test_accuracy']:.4f} | "
            + (f"{lac['test_accuracy']:.4f}" if lac else "not run")
            + " | "
            + (f"{fixed['test_accuracy']:.4f}" if fixed else "not run")
            + " |"
        )
    lines += ["", f"{label} minus each, paired by seed (95% t-interval):", ""]
    for e in sorted({r["epsilon_target"] for r in grid}):
        mine = {r["seed"]: r["test_accuracy"] for r in grid if r["epsilon_target"] == e}
        for other, title in (("lac", "DP-LAC (paper's grid)"), ("fixed", "fixed C = 1")):
            pairs = [s for s in sorted(mine) if (other, e, s) in by]
            d = [mine[s] - by[(other, e, s)]["test_accuracy"] for s in pairs]
            if len(d) < 2:
                lines.append(f"- eps {e:g}, minus {title}: fewer than two paired seeds")
                continue
            mean, lo, hi = paired_interval(d)
            if all(x == 0 for x in d):
                verdict = "identical to"  # the vote picked the same C0: the same run
            else:
                verdict = interval_verdict(lo, hi)
            lines.append(
                f"- eps {e:g}, minus {title}: {mean:+.4f} [{lo:+.4f}, {hi:+.4f}] "
                f"(n={len(d)}): {verdict} it"
            )
    return "\n".join(lines) + "\n"


def render_all(out: Path, names: Sequence[str]) -> tuple[str, list[tuple[str, str]]]:
    """The pilot's and each recorded protocol's rendering (names without a JSONL skipped)."""
    pilot_data = json.loads((out / "federated_lac_pilot.json").read_text())
    protocols = []
    for name in names:
        path = out / f"{name}.jsonl"
        if path.exists():
            runs = load_runs(path)
            sweep_path = out / f"{SWEEP_NAME}.jsonl"
            sweep = load_runs(sweep_path) if name == SWEEP_BASE and sweep_path.exists() else []
            extra = {}
            if name == RERUN_NAME and (out / f"{RERUN_BASE}.jsonl").exists():
                extra["first_run"] = load_runs(out / f"{RERUN_BASE}.jsonl")
            if name == SWEEP_BASE:  # the no-vote arm and the re-timed runs pair with it
                for key, other in (("novote", NOVOTE_NAME), ("retimed", RETIMED_NAME)):
                    path = out / f"{other}.jsonl"
                    extra[key] = load_runs(path) if path.exists() else []
                extra["ratio"] = engine_ratio(out / ROUND_TIME.name)
            text = render(
                runs, name, load_floor(out), load_setup(out, name), pilot_data, sweep=sweep,
                **extra,
            )  # fmt: skip
            protocols.append((name, text))
    return render_pilot(pilot_data), protocols


def cmd_render(args: argparse.Namespace) -> None:
    pilot, protocols = render_all(args.out, args.names)
    (args.out / "federated_lac_pilot.md").write_text(pilot)
    for name, text in protocols:
        (args.out / f"{name}.md").write_text(text)
        plot(load_runs(args.out / f"{name}.jsonl"), args.out / f"{name}.png")
        print(text)
    grid = args.out / f"{GRID_NAME}.jsonl"
    if grid.exists():  # the vote-grid variant, beside the protocol it is paired with
        text = render_grid(load_runs(grid), load_runs(args.out / f"{GRID_BASE}.jsonl"),
                           GRID_NAME, GRID_BASE)  # fmt: skip
        (args.out / f"{GRID_NAME}.md").write_text(text)
        print(text)
    if args.docs is not None:
        write_into_docs(docs_section(pilot, protocols), args.docs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("pilot", "run", "render", "splits"))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--epsilons", type=float, nargs="+", default=[8.0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--clients-per-round", type=float, default=100.0)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument(
        "--val-examples", type=int, default=600, help="server's public validation, stratified"
    )
    p.add_argument("--local-optimizer", choices=("adamw", "sgd"), default="sgd")
    p.add_argument("--optimizers", nargs="+", default=["sgd", "adamw"], help="pilot only")
    p.add_argument("--lr", type=float, default=None, help="default: adamw 1e-3, sgd 0.1")
    p.add_argument("--cache-file", default=None, help="keep the frozen-layer cache here")
    p.add_argument(
        "--vote-factors",
        type=float,
        nargs="+",
        default=None,
        help="run: the LAC/CLAC vote's candidates as multiples of C_init (default: the "
        "library's, 0.25 0.5 1); a grid other than the default belongs in its own --name",
    )
    p.add_argument(
        "--vote-memo", default=None, help="run: a folder keeping each vote's loss matrix"
    )
    p.add_argument(
        "--start-before",
        type=lambda t: datetime.fromisoformat(t).replace(tzinfo=timezone.utc),
        default=None,
        help="run: start no run (or tuned arm) after this UTC time, e.g. 2026-12-03T19:15",
    )
    p.add_argument(
        "--tune",
        nargs="+",
        default=[],
        choices=TUNED,
        help="run: these baselines privately tuned (1/3 of the budget) instead of the rules",
    )
    p.add_argument(
        "--fixed-clip",
        type=float,
        nargs="+",
        default=None,
        help="run: with --methods fixed only, the fixed rule's clip norm(s) (default 1, the "
        "protocol's); a sweep for C* belongs in its own --name, e.g. federated_lac_fixed_sweep",
    )
    p.add_argument(
        "--lac-c0",
        type=float,
        default=None,
        help="run: with --methods lac only, DP-LAC started at this C0 without the vote (all of "
        "epsilon to the rounds); in its own --name, e.g. federated_lac_novote",
    )
    p.add_argument(
        "--claims", default=None, help="run: a folder through which workers share the plan"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--docs", type=Path, default=DOCS, help="render: also write into this page")
    p.add_argument("--name", default="federated_lac_full", help="run: the results' name")
    p.add_argument(
        "--names",
        nargs="+",
        default=list(RENDERED),
        help="render: the recorded protocols, in the docs' order",
    )
    args = p.parse_args(argv)
    check_fixed_clip(args)
    check_lac_c0(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for noisy in ("transformers", "httpx", "dpfit.federated.strategy"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    commands = {"pilot": cmd_pilot, "run": cmd_run, "render": cmd_render, "splits": cmd_splits}
    commands[args.command](args)


if __name__ == "__main__":
    main()

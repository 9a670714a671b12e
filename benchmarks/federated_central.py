"""Does the federated pipeline lose anything? Non-private FedAvg against central training.

Both sides use the same data, model, local trainer and evaluation:

- **FedAvg**: the ClientApp and the server of ``dpfit federated`` over the in-process grid,
  with no noise and no clipping (``method=fixed``, z = 0, C far above any update), IID
  clients, m expected clients per round, R rounds of E local epochs each;
- **central**: the clients' trainer (``dpfit.federated.client.local_train``: AdamW, the same
  learning rate, batch size and features) run once, one optimizer, on the union of every
  client's examples, scored after the epochs that match FedAvg's example-passes
  (R E m n / (N n) epochs, n examples per client) and after ``--central-epochs``, to show
  where central training levels off.

Test accuracy is measured on the server's held-out test split (``--test-examples``, default
all of it), the same examples for both. Every option of ``benchmarks/federated.py`` (task,
clients, local training, feature cache) is accepted and means the same; the defaults are that
benchmark's (head mode: a linear head on cached frozen MiniLM features, 1000 clients of 10
examples, 100 a round).

    python benchmarks/federated_central.py --fed-rounds 5 10 30 100 \\
        --central-epochs 1 5 10 30 --eval-examples 0                       # head mode
    python benchmarks/federated_central.py --local-mode bias --clients 10 \\
        --clients-per-round 10 --examples-per-client 50 --lr 3e-3 \\
        --fed-rounds 1 2 4 8 12 --central-epochs 1 3 --eval-examples 300 \\
        --name federated_central_bias                                      # BiTFiT

Writes ``benchmarks/results/<name>.{json,md}`` after every measurement, so a stopped run keeps
what it measured (its table says it stopped); ``--from-json`` re-renders the markdown.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import federated as fb  # noqa: E402  (the protocol benchmark's task, data and feature cache)

RESULTS = Path(__file__).parent / "results"
TARGET = 0.02  # FedAvg within 2 points of central


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fed-rounds", type=int, nargs="+", default=[10, 30], help="FedAvg checkpoints")
    p.add_argument(
        "--central-epochs",
        type=float,
        nargs="*",
        default=[],
        help="extra central epoch counts (beyond those matching the FedAvg checkpoints)",
    )
    p.add_argument("--seed", type=int, default=0, help="client sampling and local shuffles")
    p.add_argument(
        "--test-examples",
        type=int,
        default=0,
        help="test examples scored (0 = the whole test split; --eval-examples caps validation)",
    )
    p.add_argument("--name", default="federated_central")
    p.add_argument("--from-json", default=None)
    own, rest = p.parse_known_args(argv)
    return own, fb.parse_args(rest + ["--partitions", "iid", "--out", str(RESULTS)])


def fedavg(task, args, rounds: list[int], seed: int, test_fn, record=None) -> list[dict]:
    """Non-private FedAvg through the app; test accuracy at each checkpoint round.

    ``record(row)`` sees each checkpoint's row as soon as it is measured."""
    from dpfit.federated.app import LocalGrid, build_strategy
    from dpfit.federated.client import build_client_app
    from dpfit.federated.strategy import ServerConfig

    cfg = ServerConfig(
        method="fixed",
        num_clients=args.clients,
        clients_per_round=args.clients_per_round,
        rounds=max(rounds),
        target_epsilon=None,
        noise_multiplier=0.0,  # non-private
        initial_clip=1e9,  # no update is clipped
        insecure_seed=seed,  # nothing to protect: the sampling is the only randomness
    )
    out: list[dict] = []
    t0 = time.perf_counter()

    def on_round(rec) -> None:
        if rec.round in rounds:
            loss, acc = test_fn(strategy.server.params)
            row = {
                "rounds": rec.round,
                "example_passes": rec.round
                * args.local_epochs
                * args.clients_per_round
                * _per_client(task, args),
                "val_accuracy": rec.accuracy,
                "test_loss": loss,
                "test_accuracy": acc,
                "seconds": time.perf_counter() - t0,
            }
            out.append(row)
            if record is not None:
                record(row)
            print(f"fedavg round {rec.round}: test acc {acc:.4f}", flush=True)

    strategy = build_strategy(cfg, task, on_round)
    strategy.start(LocalGrid.for_app(build_client_app(), task.num_clients))
    return out


def _per_client(task, args) -> float:
    """Mean examples per client (the IID clients all hold about the same number)."""
    from dpfit.federated.app import client_examples

    sizes = [len(client_examples(task, i)) for i in range(min(20, task.num_clients))]
    return float(np.mean(sizes))


def central(task, args, epochs: list[float], seed: int, test_fn, record=None) -> list[dict]:
    """The clients' trainer on the union of their data: one run of ``local_train`` (one
    optimizer) to the largest whole epoch count, scored after each epoch count asked for.

    A fractional count e = k + f continues from epoch k's parameters and generator with a
    random f of one more epoch (a fresh optimizer, like a round). ``record(row)`` sees each
    row as soon as it is measured.
    """
    from dpfit.federated import client as fed_client
    from dpfit.federated.app import client_examples, initial_arrays

    union = [e for i in range(task.num_clients) for e in client_examples(task, i)]
    texts, labels = [e.text for e in union], [e.label for e in union]
    lm = fed_client.load_local_model(task.model, task.local_mode, task.lora_r, task.seed)
    start = initial_arrays(task)
    wanted = sorted(set(epochs))
    whole_needed = {int(math.floor(ep)) for ep in wanted}
    rng = np.random.default_rng([seed, 77])
    snapshots: dict[int, tuple[list[np.ndarray], np.random.Generator, float]] = {
        0: (start, copy.deepcopy(rng), time.perf_counter())
    }

    def keep(k: int, params: list[np.ndarray]) -> None:  # lm is mid-training: store only
        if k in whole_needed:
            snapshots[k] = (params, copy.deepcopy(rng), time.perf_counter())

    t0 = time.perf_counter()
    if max(whole_needed):
        fed_client.local_train(
            lm, start, texts, labels, replace(task, local_epochs=max(whole_needed)), rng, keep
        )
    out = []
    for ep in wanted:
        whole = int(math.floor(ep))
        params, g, at = snapshots[whole]
        if ep - whole > 1e-9:  # a random part of one more epoch (a fresh optimizer, like a round)
            g = copy.deepcopy(g)
            k = max(1, round((ep - whole) * len(texts)))
            idx = g.permutation(len(texts))[:k]
            update, _ = fed_client.local_train(
                lm,
                params,
                [texts[i] for i in idx],
                [labels[i] for i in idx],
                replace(task, local_epochs=1),
                g,
            )
            params = [p + u for p, u in zip(params, update, strict=True)]
        loss, acc = test_fn(params)
        row = {
            "epochs": ep,
            "example_passes": ep * len(texts),
            "examples": len(texts),
            "test_loss": loss,
            "test_accuracy": acc,
            "train_seconds": at - t0 if whole else 0.0,
        }
        out.append(row)
        if record is not None:
            record(row)
        print(f"central {ep:g} epochs: test acc {acc:.4f}", flush=True)
    return out


def linear_optimum(task, union_size_check: int) -> dict:
    """Head mode only: the same linear head fitted to convergence on the same union.

    scikit-learn's logistic regression on the features the clients' head reads, its L2
    strength chosen on the server's validation split: where a linear head on these features
    levels off, a reference for both trainers (it is not the clients' trainer).
    """
    from sklearn.linear_model import LogisticRegression

    from dpfit.federated import client as fed_client
    from dpfit.federated.app import client_examples, eval_split

    lm = fed_client.load_local_model(task.model, task.local_mode, task.lora_r, task.seed)

    def feats(texts):
        return fed_client._Features.get(lm, texts, task.max_length).double().numpy()

    union = [e for i in range(task.num_clients) for e in client_examples(task, i)]
    assert len(union) == union_size_check
    x = feats([e.text for e in union])
    y = np.array([e.label for e in union])
    val_t, val_y = eval_split(task, "validation")
    test_t, test_y = eval_split(task, "test")
    xv, xt = feats(val_t), feats(test_t)
    scores = {}
    for c in (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0):
        clf = LogisticRegression(C=c, max_iter=5000).fit(x, y)
        scores[c] = (clf.score(xv, val_y), clf)
    best = max(scores, key=lambda c: scores[c][0])
    return {
        "C_grid": list(scores),
        "val_accuracy": {str(c): v for c, (v, _) in scores.items()},
        "chosen_C": best,
        "test_accuracy": float(scores[best][1].score(xt, np.asarray(test_y))),
    }


def _nearest(cen: list[dict], passes: float) -> dict | None:
    return min(cen, key=lambda r: abs(r["example_passes"] - passes)) if cen else None


def render(data: dict) -> str:
    """Markdown of what the JSON holds; a stopped run's table says what is missing."""
    s = data["settings"]
    fed, cen = data["fedavg"], data["central"]
    union = f"{cen[0]['examples']} " if cen else ""
    lines = [
        "# Non-private FedAvg against central training on the same data",
        "",
        f"Generated by `benchmarks/federated_central.py` ({data['machine']}). Command: "
        f"`{data['command']}`. Task: Rotten Tomatoes, {s['model']} with local mode "
        f"`{s['local_mode']}`, {s['clients']} IID clients of up to {s['examples_per_client']} "
        f"examples, {s['clients_per_round']} expected per round, {s['local_epochs']} local "
        f"epochs, batch {s['local_batch_size']}, AdamW lr {s['lr']}, max length "
        f"{s['max_length']}; test split of {data['test_examples']} examples (majority class "
        f"{data['majority']:.3f}). FedAvg: the app's server with z = 0 and no clipping. "
        "Central: the clients' trainer (`local_train`) on the union of the clients' "
        f"{union}examples, one optimizer for all its epochs.",
        "",
    ]
    if not data.get("finished", True):
        asked = data.get("fed_rounds_asked", [])
        lines += [
            f"**Stopped run** after {data['seconds'] / 60:.0f} min: it records the FedAvg "
            f"checkpoints measured ({len(fed)} of {len(asked)} asked: rounds "
            f"{', '.join(str(r) for r in asked)}) and the central epoch counts measured "
            f"({len(cen)}); rows below are only what finished.",
            "",
        ]
    lines += [
        "| FedAvg rounds | example passes | FedAvg test acc | central epochs (same passes) "
        "| central test acc | central - FedAvg |",
        "|---|---|---|---|---|---|",
    ]
    for f in fed:
        c = _nearest(cen, f["example_passes"])
        same = c is not None and abs(c["example_passes"] - f["example_passes"]) < 1
        lines.append(
            f"| {f['rounds']} | {f['example_passes']:.0f} | {f['test_accuracy']:.4f} | "
            + (
                f"{c['epochs']:g} | {c['test_accuracy']:.4f} "
                f"| {c['test_accuracy'] - f['test_accuracy']:+.4f} |"
                if same
                else "not measured | | |"
            )
        )
    if cen:
        lines += [
            "",
            "Central training at every epoch count run: "
            + ", ".join(f"{r['epochs']:g} ep: {r['test_accuracy']:.4f}" for r in cen)
            + ".",
        ]
    lines.append("")
    if data.get("linear_optimum"):
        o = data["linear_optimum"]
        lines += [
            "Reference, not a trainer under test: the same linear head fitted to convergence "
            "on the same union (scikit-learn logistic regression on the features the head "
            f"reads, L2 strength C = {o['chosen_C']:g} chosen on the validation split from "
            f"{', '.join(f'{c:g}' for c in o['C_grid'])}): test accuracy "
            f"{o['test_accuracy']:.4f}.",
            "",
        ]
    if fed and cen:
        last = fed[-1]
        best_c = max(cen, key=lambda r: r["test_accuracy"])
        gap_same = _nearest(cen, last["example_passes"])["test_accuracy"] - last["test_accuracy"]
        gap_best = best_c["test_accuracy"] - last["test_accuracy"]
        learned = best_c["test_accuracy"] > data["majority"] + 0.01
        verdict = "met" if max(gap_same, gap_best) <= TARGET else "NOT met"
        if not learned:
            verdict = "not judged: central training learned nothing"
            lines += [
                f"Central training did not learn: its best test accuracy "
                f"({best_c['test_accuracy']:.4f}) is the majority class's "
                f"({data['majority']:.4f}). At these settings the comparison below says "
                "nothing about the pipeline.",
                "",
            ]
        lines += [
            f"At FedAvg's last checkpoint ({last['rounds']} rounds): central minus FedAvg is "
            f"{gap_same:+.4f} at the nearest example-passes measured and {gap_best:+.4f} "
            f"against central's best epoch count ({best_c['epochs']:g}); the target is at most "
            f"{TARGET:.2f} ({verdict}).",
            "",
        ]
    return "\n".join(lines)


def _write(out: Path, data: dict) -> None:
    """JSON (atomically) and the markdown rendering of what has been measured so far."""
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=float))
    tmp.replace(out.with_suffix(".json"))
    out.with_suffix(".md").write_text(render(data))


def main(argv: list[str] | None = None) -> int:
    own, args = parse_args(argv)
    out = RESULTS / own.name
    if own.from_json:
        data = json.loads(Path(own.from_json).read_text())
        out.with_suffix(".md").write_text(render(data))
    else:
        import torch

        from dpfit.federated.app import eval_split, make_evaluate_fn

        if args.local_mode == "head" and args.feature_cache:
            fb.build_feature_cache(args)
        fb._setup(args)  # partitions, cached features, threads, quiet logs
        task = fb.task_config(args, "iid")
        test_task = replace(task, eval_examples=own.test_examples)
        test_fn = make_evaluate_fn(test_task, "test")
        _, test_labels = eval_split(test_task, "test")
        t0 = time.perf_counter()
        data = {
            "linear_optimum": None,
            "command": "python benchmarks/federated_central.py "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, torch {torch.__version__}",
            "settings": fb._settings(args),
            "test_examples": len(test_labels),
            "majority": max(np.mean(test_labels), 1 - np.mean(test_labels)),
            "fed_rounds_asked": sorted(own.fed_rounds),
            "finished": False,
            "seconds": 0.0,
            "fedavg": [],
            "central": [],
        }

        def record(key: str):
            def add(row: dict) -> None:  # a stopped run keeps every row measured so far
                data[key].append(row)
                data["seconds"] = time.perf_counter() - t0
                _write(out, data)

            return add

        fed = fedavg(task, args, sorted(own.fed_rounds), own.seed, test_fn, record("fedavg"))
        n_union = args.clients * _per_client(task, args)
        matched = [f["example_passes"] / n_union for f in fed]
        central(
            task,
            args,
            [round(x, 3) for x in matched] + own.central_epochs,
            own.seed,
            test_fn,
            record("central"),
        )
        if args.local_mode == "head":
            data["linear_optimum"] = linear_optimum(task, data["central"][0]["examples"])
        data["finished"] = True
        data["seconds"] = time.perf_counter() - t0
        _write(out, data)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

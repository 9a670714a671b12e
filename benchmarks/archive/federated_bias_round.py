"""CPU seconds of one batched round: DP-BiTFiT clients (``--local-mode bias``) against
``lora-top`` clients, side by side.

Why: the batched engine runs local mode ``bias`` since it got a BERT family for it
(``dpfit.federated.batched_layers.bert_bias``). In ``lora-top`` the layers below the top one
are frozen, cached once per text, and a round runs only the top layer and the head; in
``bias`` every layer trains, so only the embeddings' sum is cached and a round runs the whole
encoder for every (client, example) pair. This measures what that costs: the bundled MiniLM,
100 clients x 10 examples of the bundled Rotten Tomatoes data (IID), 2 local epochs, batch 16,
AdamW; one round = ``BatchedClients.round_replies`` for all 100 clients (local training only,
no server evaluation), the frozen part cached before the clock starts; one thread, the arms
alternated round by round, the median of 3 rounds each. A third arm times the same bias round
on the per-client path (``client.local_train`` for each client in turn, as ``--engine local``
trains them) for scale.

    PYTHONPATH=src python benchmarks/archive/federated_bias_round.py
    # writes benchmarks/results/archive/federated_bias_round.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from dpfit.federated.app import client_examples, initial_arrays
from dpfit.federated.batched import BatchedClients
from dpfit.federated.cli import LOCAL_LR
from dpfit.federated.client import TaskConfig, load_local_model, local_train

OUT = Path(__file__).resolve().parents[1] / "results" / "archive" / "federated_bias_round"
MODES = ("bias", "lora-top")
PER_CLIENT = "bias, per-client path"
ARMS = (*MODES, PER_CLIENT)


def engine(mode: str, clients: int) -> tuple[TaskConfig, BatchedClients]:
    task = TaskConfig(
        local_mode=mode, lora_r=4, local_epochs=2, local_batch_size=16, lr=LOCAL_LR[mode],
        num_clients=clients, partition="iid", examples_per_client=10, eval_examples=0, seed=0,
        local_optimizer="adamw",
    )  # fmt: skip
    lm = load_local_model(task.model, task.local_mode, task.lora_r, task.seed)
    return task, BatchedClients(lm, task, lambda p: client_examples(task, p))


def per_client_round(eng: BatchedClients, start, pids: list[int], server_round: int) -> None:
    """The same clients' local training, one ``local_train`` after another."""
    for p in pids:
        d = eng.client_data(p)
        rng = np.random.default_rng([eng.task.seed, p, server_round])
        rng.random()  # the ClientApp's failure-injection draw, as the batched engine keeps it
        local_train(eng.lm, start, [e.text for e in d], [e.label for e in d], eng.task, rng)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    pids = list(range(args.clients))
    arms = {}
    for mode in MODES:
        task, eng = engine(mode, args.clients)
        texts = [e.text for d in eng._data(pids) for e in d]  # the frozen part, cached
        eng._project(texts)  # lora-top: the top layer's frozen q/k/v products too
        arms[mode] = (task, eng, initial_arrays(task))
    cpu: dict[str, list[float]] = {m: [] for m in ARMS}
    for r in range(args.rounds):
        for arm in ARMS if r % 2 == 0 else reversed(ARMS):
            _, eng, start = arms["bias" if arm == PER_CLIENT else arm]
            c0 = time.process_time()
            if arm == PER_CLIENT:
                per_client_round(eng, start, pids, r + 1)
            else:
                eng.round_replies(start, pids, r + 1)
            cpu[arm].append(time.process_time() - c0)
            print(f"round {r + 1} {arm}: {cpu[arm][-1]:.1f} CPU-s", flush=True)
    median = {m: statistics.median(v) for m, v in cpu.items()}
    result = {
        "question": "CPU seconds of one batched round, local mode bias against lora-top",
        "model": "bundled MiniLM (all-MiniLM-L6-v2)",
        "clients": args.clients,
        "examples_per_client": 10,
        "max_length": arms["bias"][0].max_length,
        "local_epochs": 2,
        "local_batch_size": 16,
        "threads": torch.get_num_threads(),
        "trainable_values": {m: int(sum(a.size for a in arms[m][2])) for m in MODES},
        "cpu_s": cpu,
        "median_cpu_s": median,
        "ratio_bias_over_lora_top": median["bias"] / median["lora-top"],
        "ratio_per_client_over_batched_bias": median[PER_CLIENT] / median["bias"],
        "load_average": os.getloadavg(),
        "machine": platform.processor() or platform.machine(),
        "command": "PYTHONPATH=src python benchmarks/archive/federated_bias_round.py",
    }
    OUT.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [
        f"| {m} | {result['trainable_values'][m.split(',')[0]]:,} | {median[m]:.1f} | "
        + ", ".join(f"{x:.1f}" for x in cpu[m])
        + " |"
        for m in ARMS
    ]
    md = [
        f"# One batched round, bias against lora-top (`{result['command']}`)",
        "",
        f"Bundled MiniLM, {args.clients} clients x 10 Rotten Tomatoes examples (IID), "
        f"2 local epochs, batch 16, AdamW, sequences cut at {result['max_length']} tokens; a "
        "round is every client's local training (`BatchedClients.round_replies`, no server "
        "evaluation), the frozen part cached beforehand; one thread, arms alternated. The "
        "per-client row trains the same clients with `client.local_train` one after another "
        "(as `--engine local` does).",
        "",
        "| local mode | trained values | median CPU-s a round | rounds (CPU-s) |",
        "|---|---|---|---|",
        *rows,
        "",
        f"bias / lora-top: {result['ratio_bias_over_lora_top']:.1f}x; per-client / batched "
        f"(bias): {result['ratio_per_client_over_batched_bias']:.1f}x. Load average during the "
        f"run: {', '.join(f'{x:.1f}' for x in result['load_average'])} (shared 2-core machine).",
        "",
    ]
    OUT.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()

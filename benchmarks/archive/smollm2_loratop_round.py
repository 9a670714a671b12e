"""CPU seconds of one batched-engine round with LoRA-on-the-top-layer clients of SmolLM2.

Why: ``--engine batched`` runs local mode ``lora-top`` on LLaMA-style decoders
(``dpfit.federated.batched_layers.llama``); the target was <= 30 CPU-seconds a round for the
DP-LAC protocol's round (100 clients of 10 bundled Rotten Tomatoes examples, 2 local epochs,
batch 16, sequences cut at 48 tokens) with the bundled SmolLM2-135M, one thread. Measures the
clients' part of a round (``BatchedClients.round_replies``: local training of every sampled
client) with ``time.process_time``, the median of ``--rounds`` rounds after the frozen layers'
cache is filled, and the fill's own CPU time (once per text, for every client's examples).
``--per-client`` clients also run the per-client path (``client.local_train``, the whole
model per step) for scale.

    PYTHONPATH=src python benchmarks/archive/smollm2_loratop_round.py
    # writes benchmarks/results/archive/smollm2_loratop_round.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results" / "archive"
TARGET_CPU_S = 30.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-client", type=int, default=3, help="clients timed on the local path")
    p.add_argument("--out", default=str(RESULTS / "smollm2_loratop_round"))
    args = p.parse_args()

    import numpy as np
    import torch

    from dpfit.federated.batched import BatchedClients
    from dpfit.federated.client import TaskConfig, load_local_model, local_train
    from dpfit.federated.examples import client_examples

    torch.set_num_threads(1)
    task = TaskConfig(
        model="smollm2", local_mode="lora-top", lora_r=4, max_length=48, local_epochs=2,
        local_batch_size=16, lr=1e-3, num_clients=args.clients, partition="iid",
        examples_per_client=10, eval_examples=0, seed=0,
    )  # fmt: skip
    c0 = time.process_time()
    lm = load_local_model(task.model, task.local_mode, task.lora_r, task.seed)
    load_cpu = time.process_time() - c0
    engine = BatchedClients(lm, task, lambda p: client_examples(task, p))
    pids = list(range(args.clients))
    data = [client_examples(task, p) for p in pids]
    texts = [e.text for d in data for e in d]
    c0 = time.process_time()
    engine.cache.fill(texts)
    fill_cpu = time.process_time() - c0
    tokens = sum(len(engine.cache.store[t]) for t in dict.fromkeys(texts))
    start = lm.initial
    rounds, first = [], []
    for r in range(1, args.rounds + 1):
        c0, t0 = time.process_time(), time.perf_counter()
        replies = engine.round_replies(start, pids, r)
        rounds.append({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0})
        assert len(replies) == len(pids)
        if r == 1:
            first = replies
    per_client, gaps = [], []
    for p in pids[: args.per_client]:
        rng = np.random.default_rng([task.seed, p, 1])
        rng.random()  # the ClientApp's failure-injection draw, as round_replies keeps it
        c0 = time.process_time()
        ref, _ = local_train(
            lm, start, [e.text for e in data[p]], [e.label for e in data[p]], task, rng
        )
        per_client.append(time.process_time() - c0)
        # float32: the same update as round 1's batched reply, up to rounding
        got = first[p].update
        diff = np.sqrt(sum(float(((g - x) ** 2).sum()) for g, x in zip(got, ref, strict=True)))
        norm = np.sqrt(sum(float((x**2).sum()) for x in ref))
        gaps.append(diff / norm)
    median = statistics.median(x["cpu_s"] for x in rounds)
    result = {
        "command": "PYTHONPATH=src python benchmarks/archive/smollm2_loratop_round.py",
        "task": {
            k: getattr(task, k)
            for k in (
                "model",
                "local_mode",
                "lora_r",
                "max_length",
                "local_epochs",
                "local_batch_size",
            )
        },  # fmt: skip
        "clients_per_round": args.clients,
        "examples_per_client": task.examples_per_client,
        "texts_cached": len(set(texts)),
        "tokens_cached": tokens,
        "model_load_cpu_s": load_cpu,
        "cache_fill_cpu_s": fill_cpu,
        "rounds": rounds,
        "round_cpu_s_median": median,
        "target_cpu_s": TARGET_CPU_S,
        "meets_target": median <= TARGET_CPU_S,
        "per_client_path_cpu_s": per_client,
        "update_relative_gap_to_per_client_path": gaps,
        "per_client_path_round_estimate_cpu_s": (
            statistics.mean(per_client) * args.clients if per_client else None
        ),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "loadavg": os.getloadavg(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    est = result["per_client_path_round_estimate_cpu_s"]
    each = ", ".join(f"{x['cpu_s']:.2f}" for x in rounds)
    md = [
        f"# One batched round, SmolLM2-135M lora-top (`{result['command']}`)",
        "",
        f"{args.clients} clients x {task.examples_per_client} bundled Rotten Tomatoes examples, "
        f"2 local epochs, batch 16, max_length 48, LoRA r=4 on the top decoder layer's "
        "q_proj/v_proj + head, one thread, CPU seconds (`time.process_time`).",
        "",
        "| what | CPU s |",
        "|---|---|",
        f"| one round, median of {len(rounds)} after the cache fill ({each}) | {median:.2f} |",
        f"| cache fill, once ({len(set(texts))} texts, {tokens} tokens, 29 frozen layers) "
        f"| {fill_cpu:.1f} |",
        f"| model load | {load_cpu:.1f} |",
    ]
    if est is not None:
        md.append(
            f"| per-client path, one client (mean of {len(per_client)}; x{args.clients} = "
            f"{est:.0f} s a round) | {statistics.mean(per_client):.2f} |"
        )
    if gaps:
        md.append(
            f"| (check) round 1's batched update against the per-client path's, "
            f"max relative L2 gap over those clients, float32 | {max(gaps):.1e} |"
        )
    md += [
        "",
        f"Target <= {TARGET_CPU_S:.0f} CPU-s a round: "
        f"{'met' if result['meets_target'] else 'NOT met'}. Load average at the end: "
        f"{', '.join(f'{x:.2f}' for x in result['loadavg'])} (shared machine).",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()

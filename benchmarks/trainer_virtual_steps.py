"""Peak memory of DPTrainer virtual steps: a logical Poisson batch of 1,024
processed in physical batches of 32, against a 32-example non-private step.

Each arm runs in a fresh worker process (one thread) on the same randomly initialised BERT
(bert-tiny shape: 2 layers, hidden 128, 2 heads, intermediate 512; fixed-length random token
sequences, no padding), bias-only training plus the classification head in every arm:

* nonpriv-32: transformers ``Trainer``, shuffled batches of 32 (the target's reference),
* dp-32: ``DPTrainer``, Poisson batches of expected size 32, one pass each,
* dp-1024-phys-32: ``DPTrainer``, expected logical batch 1,024, ``physical_batch_size=32``,
* dp-1024-one-pass: ``DPTrainer``, expected logical batch 1,024 in one forward (contrast).

The 32-example arms take as many steps as the virtual arm takes physical batches (64 by
default): peak RSS grows a little with the number of forward/backward passes (allocator
fragmentation), so equal counts compare like with like.

Per arm it reports (1) peak RSS during ``trainer.train()`` minus RSS just before it (Linux:
peak reset through /proc/self/clear_refs, read from VmHWM) and (2) the largest number of bytes
autograd saved for backward in any one forward (unique storages, parameters excluded:
benchmarks/speed_memory.SavedTensorMeter), a deterministic measure of activation memory.

    python benchmarks/trainer_virtual_steps.py                  # defaults below
    python benchmarks/trainer_virtual_steps.py --reps 1 --no-one-pass --out /tmp/tv

Writes <out>.json and <out>.md (default benchmarks/results/trainer_virtual_steps).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
ARMS = ("nonpriv-32", "dp-32", "dp-1024-phys-32", "dp-1024-one-pass")
MODEL = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512)


def worker(spec: dict) -> dict:
    import gc
    import logging
    import time

    import torch
    from harness.memory import peak_rss, reset_peak_rss, rss_now
    from speed_memory import SavedTensorMeter
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainingArguments,
        default_data_collator,
    )

    from dpfit.integrations import DPTrainer, PrivacyArguments
    from dpfit.params import make_bias_trainable

    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    arm, n, length = spec["arm"], spec["n"], spec["length"]
    model = BertForSequenceClassification(BertConfig(vocab_size=1000, num_labels=2, **MODEL))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 1000, (n, length), generator=g)
    labels = torch.randint(0, 2, (n,), generator=g)

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return {"input_ids": ids[i], "attention_mask": torch.ones(length, dtype=torch.long),
                    "labels": labels[i]}  # fmt: skip

    logical = 1024 if arm.startswith("dp-1024") else 32
    steps = spec["dp_steps"] if logical == 1024 else spec["small_steps"]
    targs = TrainingArguments(
        output_dir=spec["tmp"], per_device_train_batch_size=logical, max_steps=steps,
        learning_rate=1e-3, report_to=[], use_cpu=True, save_strategy="no", seed=0,
        disable_tqdm=True, logging_strategy="no", dataloader_num_workers=0,
    )  # fmt: skip
    common = dict(
        model=model, args=targs, train_dataset=Data(), data_collator=default_data_collator
    )
    if arm == "nonpriv-32":
        make_bias_trainable(model, train_head=("classifier",))
        trainer = Trainer(**common)
    else:
        physical = 32 if arm == "dp-1024-phys-32" else None
        privacy = PrivacyArguments(noise_multiplier=1.0, physical_batch_size=physical)
        trainer = DPTrainer(**common, privacy=privacy)
    meters: list[SavedTensorMeter] = []
    forward_rows: list[int] = []

    def new_meter(module, args, kwargs):
        meters.append(SavedTensorMeter(model))
        forward_rows.append(int(kwargs["input_ids"].shape[0]))

    model.register_forward_pre_hook(new_meter, with_kwargs=True)

    def pack(t):
        if meters:
            meters[-1].add(t)
        return t

    gc.collect()
    resettable = reset_peak_rss()
    base = rss_now()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.train()
    wall = time.perf_counter() - t0
    peak = peak_rss(resettable) - base
    return {
        "arm": arm,
        "rep": spec["rep"],
        "logical_steps": trainer.state.global_step,
        "forwards": len(forward_rows),
        "largest_forward": max(forward_rows),
        "examples_forwarded": sum(forward_rows),
        "peak_rss_delta_bytes": int(peak),
        "mem_probe": "VmHWM" if resettable else "ru_maxrss",
        "max_saved_bytes_per_forward": max(m.bytes for m in meters),
        "wall_s": wall,
    }


def run_one(spec: dict, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "res.json"
        spec = {**spec, "tmp": tmp}
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", json.dumps(spec), "--result", str(out)],
            env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if proc.returncode != 0:
            raise SystemExit(f"worker {spec['arm']} failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def mb(b: float) -> str:
    return f"{b / 2**20:.1f}"


def markdown(rows: list[dict], meta: dict) -> str:
    by = {a: [r for r in rows if r["arm"] == a] for a in meta["arms"]}
    med = {a: {k: statistics.median(r[k] for r in rs) for k in (
        "peak_rss_delta_bytes", "max_saved_bytes_per_forward", "wall_s")} for a, rs in by.items()}  # fmt: skip
    ref = med["nonpriv-32"]
    lines = [
        "# DPTrainer virtual steps: peak memory",
        "",
        f"Output of `{meta['command']}`. Model: randomly initialised BERT (2 layers, hidden 128, "
        f"2 heads, intermediate 512), sequences of {meta['length']} tokens, {meta['n']} examples, "
        "bias-only training plus the head in every arm, one thread, "
        f"{meta['reps']} worker process(es) per arm (medians). Peak RSS = peak during "
        f"`trainer.train()` minus RSS just before ({rows[0]['mem_probe']}); saved = largest "
        "number of bytes autograd saved for backward in one forward (unique storages, "
        f"parameters excluded). Non-private 32 and DP 32: {meta['small_steps']} steps; "
        f"logical 1,024: {meta['dp_steps']} logical steps (Poisson, sigma 1). Machine: "
        f"{meta['machine']}.",
        "",
        "| arm | logical steps | largest forward (any rep) | peak RSS MB | / non-private 32 | saved MB per "
        "forward | / non-private 32 | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in meta["arms"]:
        r0, m = by[a][0], med[a]
        lines.append(
            f"| {a} | {r0['logical_steps']} | {max(r['largest_forward'] for r in by[a])} | "
            f"{mb(m['peak_rss_delta_bytes'])} | "
            f"{m['peak_rss_delta_bytes'] / ref['peak_rss_delta_bytes']:.2f} | "
            f"{mb(m['max_saved_bytes_per_forward'])} | "
            f"{m['max_saved_bytes_per_forward'] / ref['max_saved_bytes_per_forward']:.2f} | "
            f"{m['wall_s']:.1f} |"
        )
    per_rep = ", ".join(mb(r["peak_rss_delta_bytes"]) for r in by["dp-1024-phys-32"])
    ref_rep = ", ".join(mb(r["peak_rss_delta_bytes"]) for r in by["nonpriv-32"])
    lines += ["", f"Peak RSS per repetition, MB: dp-1024-phys-32 {per_rep}; nonpriv-32 {ref_rep}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker")
    ap.add_argument("--result")
    ap.add_argument("--n", type=int, default=8192, help="training examples (q = 1024 / n)")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--dp-steps", type=int, default=2, help="logical steps of 1,024")
    ap.add_argument(
        "--small-steps", type=int, default=64,
        help="steps of the 32-example arms (default: as many forwards as 2 logical steps of 32)",
    )  # fmt: skip
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-one-pass", action="store_true", help="skip dp-1024-one-pass")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=str(HERE / "results" / "trainer_virtual_steps"))
    args = ap.parse_args(argv)
    if args.worker:
        Path(args.result).write_text(json.dumps(worker(json.loads(args.worker))))
        return 0
    arms = [a for a in ARMS if not (args.no_one_pass and a == "dp-1024-one-pass")]
    base = dict(n=args.n, length=args.length, dp_steps=args.dp_steps, small_steps=args.small_steps)
    rows = []
    for rep in range(args.reps):  # arms interleaved, order rotated per repetition
        for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:
            rows.append(run_one({**base, "arm": arm, "rep": rep}, args.timeout))
            r = rows[-1]
            print(f"{arm:18s} rep {rep}: peak RSS {mb(r['peak_rss_delta_bytes'])} MB, saved "
                  f"{mb(r['max_saved_bytes_per_forward'])} MB/forward, {r['wall_s']:.1f} s",
                  flush=True)  # fmt: skip
    meta = {
        **base,
        "reps": args.reps,
        "arms": arms,
        "command": "python benchmarks/trainer_virtual_steps.py " + " ".join(argv or sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, meta))
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

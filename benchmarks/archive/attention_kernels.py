"""Eager attention against SDPA for the bundled MiniLM on CPU: which kernel `dpfit train` runs.

One question: at the lengths `dpfit train` pads text batches to, which attention kernel makes a
bias-only training step (train mode, dropout on, padding mask, forward and backward, as the
main job runs it) faster on this CPU? `dpfit.attention.EAGER_MAX_LENGTH` follows the answer.
Each round runs both kernels once, in alternating order, so the machine's load falls on both
alike; 3 warm-up rounds, then medians of the timed ones. Also recorded: the largest difference
between the two kernels' outputs in eval mode (float32; the same function, so rounding only).
Budget: about 3 CPU-minutes.

    PYTHONPATH=src python benchmarks/archive/attention_kernels.py [--threads 1] [--timed 7]
        [--lengths 28,64,128,512] [--out benchmarks/results/archive/attention_kernels]

Writes benchmarks/results/archive/attention_kernels.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results" / "archive"
# (padded length, batch): the recipe's physical batch of 56 at its lengths, a smaller batch for
# the window length a long-text run might use
SHAPES = ((28, 56), (64, 56), (128, 56), (512, 8))


def _model(kernel: str, dropout: float | None = None):
    """dropout: every rate of the config (dpfit.dropout), as a private `dpfit train` builds it
    (0); None: the model's own (0.1)."""
    from transformers import AutoConfig, BertModel

    from dpfit.data.bundled import minilm_path
    from dpfit.dropout import set_config_rates

    config = AutoConfig.from_pretrained(minilm_path())
    if dropout is not None:
        set_config_rates(config, dropout)
    m = BertModel.from_pretrained(minilm_path(), config=config, attn_implementation=kernel)
    for name, p in m.named_parameters():
        p.requires_grad_(name.endswith("bias"))
    return m


def _batch(tokenizer, texts, length: int, batch: int):
    if length > 128:  # long inputs: reviews joined, the last fifth padding
        texts = [" ".join(texts[i * 30 : (i + 1) * 30]) for i in range(batch)]
    enc = tokenizer(list(texts[:batch]), truncation=True, padding="max_length",
                    max_length=length, return_tensors="pt")  # fmt: skip
    if length > 128:
        enc["attention_mask"][:, int(0.8 * length) :] = 0
    return enc


def run(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from dpfit.data.bundled import minilm_path
    from dpfit.data.text import bundled_rotten_tomatoes

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    texts = bundled_rotten_tomatoes(seed=0).train.texts
    models = {k: _model(k, args.dropout) for k in ("sdpa", "eager")}
    rows = []
    for length, batch in [s for s in SHAPES if s[0] in args.lengths]:
        enc = _batch(tokenizer, texts, length, batch)
        mask = enc["attention_mask"].bool()
        with torch.no_grad():
            outs = {k: m.eval()(**enc).last_hidden_state for k, m in models.items()}
        diff = float((outs["sdpa"] - outs["eager"])[mask].abs().max())
        for prec in ("fp32", "bf16"):

            def step(m, prec=prec, enc=enc):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prec == "bf16"):
                    out = m.train()(**enc).last_hidden_state
                out.float().square().mean().backward()

            times: dict[str, list[float]] = {k: [] for k in models}
            for r in range(3 + args.timed):
                order = list(models) if r % 2 == 0 else list(models)[::-1]
                for k in order:
                    t0 = time.perf_counter()
                    step(models[k])
                    if r >= 3:
                        times[k].append(time.perf_counter() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"length": length, "batch": batch, "precision": prec,
                         "sdpa_s": med["sdpa"], "eager_s": med["eager"],
                         "eager_over_sdpa": med["eager"] / med["sdpa"],
                         "max_abs_diff_fp32_eval": diff})  # fmt: skip
            print(rows[-1], file=sys.stderr, flush=True)
    return {
        "threads": args.threads,
        "timed": args.timed,
        "torch": torch.__version__,
        "cpu": _cpu_name(),
        "load_average_at_start": os.getloadavg()[0],
        "dropout": args.dropout,
        "rows": rows,
        "command": "python benchmarks/archive/attention_kernels.py " + " ".join(sys.argv[1:]),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _dropout_words(res: dict) -> str:
    rate = res.get("dropout")  # results recorded before the option ran the model's 0.1
    return "dropout on" if rate is None else "dropout off" if rate == 0 else f"dropout {rate:g}"


def render(res: dict) -> str:
    lines = [
        "# Eager attention against SDPA: the bundled MiniLM's bias-only training step on CPU",
        "",
        f"Generated by `{res['command'].strip()}` (`benchmarks/attention_kernels.py`). "
        f"{res['cpu']}, torch {res['torch']}, {res['threads']} thread(s), load average at "
        f"start {res['load_average_at_start']:.1f}. Train mode ({_dropout_words(res)}), padding mask, "
        f"forward and backward with the biases trainable; 3 warm-up + {res['timed']} timed "
        "rounds, both kernels once per round in alternating order; medians.",
        "",
        "| padded length | batch | precision | SDPA s/step | eager s/step | eager / SDPA | "
        "largest output difference (fp32, eval) |",
        "|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['length']} | {r['batch']} | {r['precision']} | {r['sdpa_s']:.3f} | "
            f"{r['eager_s']:.3f} | {r['eager_over_sdpa']:.3f} | "
            f"{r['max_abs_diff_fp32_eval']:.1e} |"
        )
    lines.append("")
    for prec in ("fp32", "bf16"):
        rs = [r for r in res["rows"] if r["precision"] == prec]
        faster = [r["length"] for r in rs if r["eager_over_sdpa"] < 1]
        lines.append(
            f"- {prec}: eager faster at lengths {faster or 'none'}, SDPA as fast or faster at "
            f"{[r['length'] for r in rs if r['eager_over_sdpa'] >= 1] or 'none'}."
        )
    lines += [
        "",
        "`dpfit train` runs eager attention on CPU under bf16 autocast for inputs of at most "
        "`dpfit.attention.EAGER_MAX_LENGTH` tokens (the longest measured here), and SDPA in "
        "float32, for longer inputs and on GPUs.",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timed", type=int, default=7)
    p.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")],
                   default=[s[0] for s in SHAPES], help="a subset of the padded lengths")  # fmt: skip
    p.add_argument("--out", type=Path, default=RESULTS / "attention_kernels")
    p.add_argument(
        "--dropout", type=float, default=None,
        help="every dropout rate of the model's config (0: as a private dpfit train runs)",
    )  # fmt: skip
    p.add_argument("--from-json", type=Path, help="render a recorded result; measure nothing")
    args = p.parse_args(argv)
    if args.from_json:
        res = json.loads(args.from_json.read_text())
    else:
        res = run(args)
        args.out.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    md = render(res)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Privacy-utility on the bundled model and data: is DP-BiTFiT as good as the paper says?

Test accuracy of the bundled all-MiniLM-L6-v2 + a new classification head on the bundled
Rotten Tomatoes snippets (split by movie), for:
  non-private full fine-tuning, non-private bias-only (BiTFiT),
  DP-BiTFiT at epsilon in {1, 2, 4, 8}, and DP full fine-tuning at epsilon 8,
all on the same split, the same training subset, the same seeds and the same step budget.
delta = 1e-5 (smaller than 1/n^1.1 for every n used here).

DP full fine-tuning uses dpfit's `mode="full"` when it works for BERT, else Opacus (hooks mode,
Poisson sampling, embeddings frozen: Opacus cannot give per-example gradients for the
broadcast position/token-type embeddings, and the 11.7M-entry word embedding would dominate
the cost). Which one ran is recorded per row.

CPU note: on a shared 2-core machine the full data takes hours; the default uses a random
subset of the training split and a short max length, and says so in the table header.

    python benchmarks/utility.py                       # default subset, seed 0
    python benchmarks/utility.py --train-examples 0    # all training data
    python benchmarks/utility.py --seeds 0 1 2
"""

from __future__ import annotations

import os

# Must precede the torch import: OpenMP threads spin-wait by default, which on a shared machine
# makes two threads many times slower than one.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from dpfit.train import TrainConfig, evaluate, prepare_data, train  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DELTA = 1e-5


@dataclass(frozen=True)
class Setting:
    name: str
    private: bool
    mode: str  # bias | full
    epsilon: float | None
    lr: float


def settings(
    epsilons: list[float], lr_bias: float, lr_full: float, lr_dp_full: float
) -> list[Setting]:
    out = [
        Setting("non-private full FT", False, "full", None, lr_full),
        Setting("non-private bias-only", False, "bias", None, lr_bias),
    ]
    out += [Setting(f"DP-BiTFiT eps={e:g}", True, "bias", e, lr_bias) for e in epsilons]
    out.append(Setting("DP full FT eps=8", True, "full", 8.0, lr_dp_full))
    return out


def run_dpfit(s: Setting, args, seed: int) -> dict:
    cfg = TrainConfig(
        max_train_examples=args.train_examples or None,
        epsilon=s.epsilon if s.private else 8.0,
        delta=DELTA,
        epochs=args.epochs,
        batch_size=args.batch_size,
        physical_batch_size=args.physical_batch_size,
        lr=s.lr,
        max_length=args.max_length,
        seed=seed,
        non_private=not s.private,
        mode=s.mode,
        clipping=args.clipping,
    )
    res = train(cfg)
    m = res.metrics
    return {
        "accuracy": m["accuracy"],
        "epsilon": m["epsilon"] if s.private else None,
        "noise_multiplier": m["noise_multiplier"],
        "steps": m["steps"],
        "trainable_fraction": m["trainable_fraction"],
        "train_time_s": m["train_time_s"],
        "engine": "dpfit",
    }


def run_opacus_full(s: Setting, args, seed: int) -> dict:
    """DP full fine-tuning with Opacus (Poisson sampling, virtual steps), embeddings frozen."""
    import random

    from opacus import PrivacyEngine as OpacusEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    from dpfit.models import load_classifier
    from dpfit.train import encode, make_collate

    cfg = TrainConfig(
        max_train_examples=args.train_examples or None, max_length=args.max_length, seed=seed
    )
    data = prepare_data(cfg)
    random.seed(seed)
    torch.manual_seed(seed)
    loaded = load_classifier(None, data.train.label_names, seed=seed)
    model, tok = loaded.model, loaded.tokenizer
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith("bert.embeddings."))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    items = encode(data.train, tok, args.max_length)
    collate = make_collate(tok.pad_token_id)
    loader = torch.utils.data.DataLoader(items, batch_size=args.batch_size, collate_fn=collate)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=s.lr)
    engine = OpacusEngine(accountant="rdp")
    model.train()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        target_epsilon=s.epsilon,
        target_delta=DELTA,
        epochs=args.epochs,
        max_grad_norm=1.0,
        poisson_sampling=True,
    )
    t0 = time.perf_counter()
    steps = 0
    for _ in range(args.epochs):
        with BatchMemoryManager(
            data_loader=loader,
            max_physical_batch_size=args.physical_batch_size,
            optimizer=optimizer,
        ) as mem_loader:
            for batch in mem_loader:
                if batch["input_ids"].shape[0] == 0:
                    optimizer.zero_grad()
                    optimizer.step()
                    continue
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                if not optimizer._is_last_step_skipped:
                    steps += 1
    train_time = time.perf_counter() - t0
    base = model._module
    acc = evaluate(base, tok, data.test, args.max_length, 64).accuracy
    return {
        "accuracy": acc,
        "epsilon": engine.get_epsilon(DELTA),
        "noise_multiplier": optimizer.noise_multiplier,
        "steps": steps,
        "trainable_fraction": trainable / total,
        "train_time_s": train_time,
        "engine": "opacus (embeddings frozen)",
    }


def dp_full(s: Setting, args, seed: int) -> dict:
    try:
        return run_dpfit(s, args, seed)
    except Exception as e:  # dpfit full mode may not support this model yet
        logging.warning(
            "dpfit mode='full' failed (%s: %s); falling back to Opacus", type(e).__name__, e
        )
    return run_opacus_full(s, args, seed)


def summarize(rows: list[dict]) -> dict[str, dict]:
    by: dict[str, list[dict]] = {}
    for r in rows:
        if "accuracy" in r:
            by.setdefault(r["setting"], []).append(r)
    out = {}
    for name, rs in by.items():
        accs = [r["accuracy"] for r in rs]
        out[name] = {
            "mean": statistics.fmean(accs),
            "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "n_seeds": len(accs),
            "epsilon": rs[0].get("epsilon"),
            "steps": rs[0]["steps"],
            "sigma": rs[0].get("noise_multiplier"),
            "trainable_fraction": rs[0]["trainable_fraction"],
            "train_time_s": statistics.fmean(r["train_time_s"] for r in rs),
            "engine": rs[0]["engine"],
        }
    return out


def majority_baseline(seed: int = 0) -> float:
    """Accuracy of always predicting the test split's most common class: the floor to beat."""
    test = prepare_data(TrainConfig(seed=seed)).test
    return max(test.class_counts().values()) / len(test)


def markdown(
    summary: dict[str, dict], header: str, failures: list[dict], majority: float | None = None
) -> str:
    lines = [
        header,
        "",
        *(
            [
                f"Majority-class baseline (always 'fresh') on this test split: {100 * majority:.1f}%.",
                "",
            ]
            if majority is not None
            else []
        ),
        "| setting | test accuracy | seeds | epsilon (delta=1e-5) | sigma | steps | trained | train time | engine |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary.items():
        acc = f"{100 * s['mean']:.1f}" + (f" ± {100 * s['std']:.1f}" if s["n_seeds"] > 1 else "")
        eps = "∞" if s["epsilon"] is None else f"{s['epsilon']:.2f}"
        sigma = "-" if s["sigma"] is None else f"{s['sigma']:.3f}"
        lines.append(
            f"| {name} | {acc} | {s['n_seeds']} | {eps} | {sigma} | {s['steps']} | "
            f"{100 * s['trainable_fraction']:.2f}% | {s['train_time_s']:.0f} s | {s['engine']} |"
        )
    for f in failures:
        lines.append(f"| {f['setting']} | failed: {f['error'][:80]} | | | | | | | |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, dict], path: Path, title: str, majority: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    bitfit = sorted(
        (s["epsilon"], s["mean"], s["std"]) for n, s in summary.items() if n.startswith("DP-BiTFiT")
    )
    if bitfit:
        e, m, sd = zip(*bitfit, strict=True)
        ax.errorbar(
            e,
            [100 * x for x in m],
            yerr=[100 * x for x in sd],
            marker="o",
            label="DP-BiTFiT",
            capsize=3,
        )
    styles = {"non-private full FT": "k--", "non-private bias-only": "g:"}
    for name, style in styles.items():
        if name in summary:
            ax.axhline(100 * summary[name]["mean"], ls=style[1:], color=style[0], label=name)
    if majority is not None:
        ax.axhline(100 * majority, ls="-.", color="gray", label="majority class")
    full = summary.get("DP full FT eps=8")
    if full is not None:
        ax.plot([full["epsilon"]], [100 * full["mean"]], "rs", label="DP full FT")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("epsilon (delta = 1e-5)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--train-examples", type=int, default=2000, help="random subset size (0 = all)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--physical-batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--epsilons", type=float, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--lr-bias", type=float, default=5e-3)
    p.add_argument("--lr-full", type=float, default=1e-4)
    p.add_argument("--lr-dp-full", type=float, default=5e-4)
    p.add_argument("--clipping", default="flat")
    p.add_argument("--only", nargs="*", help="run only settings whose name contains one of these")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--tag", default="utility")
    p.add_argument("--from-json", type=Path, help="rewrite the table and plot from a saved JSON")
    args = p.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        maj = majority_baseline(saved["runs"][0]["seed"] if saved["runs"] else 0)
        md = markdown(saved["summary"], saved["header"], saved["failures"], maj)
        (args.out / f"{args.tag}.md").write_text(md)
        if saved["summary"]:
            title = saved.get("title", "MiniLM on Rotten Tomatoes")
            plot(saved["summary"], args.out / f"{args.tag}.png", title, maj)
        print(md)
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / f"{args.tag}_runs.jsonl"
    all_settings = settings(args.epsilons, args.lr_bias, args.lr_full, args.lr_dp_full)
    if args.only:
        all_settings = [s for s in all_settings if any(k in s.name for k in args.only)]
    rows, failures = [], []
    for seed in args.seeds:
        for s in all_settings:
            t0 = time.perf_counter()
            print(
                f"[{time.strftime('%H:%M:%S')}] {s.name}, seed {seed} ...",
                file=sys.stderr,
                flush=True,
            )
            try:
                fn = dp_full if (s.private and s.mode == "full") else run_dpfit
                r = {"setting": s.name, "seed": seed, **asdict(s), **fn(s, args, seed)}
                rows.append(r)
            except Exception as e:
                traceback.print_exc()
                r = {"setting": s.name, "seed": seed, "error": f"{type(e).__name__}: {e}"}
                failures.append(r)
            r["wall_s"] = time.perf_counter() - t0
            with open(jsonl, "a") as f:
                f.write(json.dumps(r) + "\n")
            print(
                f"    -> {r.get('accuracy', r.get('error'))} ({r['wall_s']:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    summary = summarize(rows)
    n_train = args.train_examples or "all"
    header = (
        f"Bundled all-MiniLM-L6-v2 + new head, bundled Rotten Tomatoes (split by movie, test "
        f"split scored in full). Training on a random {n_train} training examples, "
        f"{args.epochs} epochs, logical batch {args.batch_size} (Poisson for DP), max length "
        f"{args.max_length}, clipping {args.clipping}, R=1, AdamW lr bias {args.lr_bias:g} / "
        f"full {args.lr_full:g} / DP full {args.lr_dp_full:g}; seeds {args.seeds}; "
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads."
    )
    maj = majority_baseline(args.seeds[0])
    md = markdown(summary, header, failures, maj)
    (args.out / f"{args.tag}.md").write_text(md)
    (args.out / f"{args.tag}.json").write_text(
        json.dumps(
            {"header": header, "summary": summary, "runs": rows, "failures": failures}, indent=2
        )
    )
    if summary:
        plot(
            summary,
            args.out / f"{args.tag}.png",
            f"MiniLM on Rotten Tomatoes, {n_train} train examples",
        )
    print(md)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

"""Private bias+LoRA on a causal LM: does FFA-LoRA (lora_A frozen) do as well as training both?

One question. Private `--mode bias+lora` runs freeze every lora_A by default (FFA-LoRA,
dpfit.recipe.PRIVATE_LORA_FREEZE_A), a choice made on the classification suite
(docs/bias_lora.md). It applies to private causal-LM runs too, where it was not measured.
Here: the bundled SmolLM2-135M (biases added: DP-BiTFiT-Add) on the bundled 2012 convention
speeches in 256-token windows, privacy unit window, eps 8, the recipe's rate rule for a
pretrained language model at these steps (lr = dpfit.recipe.LM_WALK[mode] / sqrt(steps)),
a small logical batch for the CPU. Arms, each trained from a fresh copy of the prepared
model through `dpfit.train.train` (the loop `dpfit train` runs):

    bias              DP-BiTFiT-Add alone (the causal-LM default mode)
    bias+lora         biases + LoRA with lora_A trained (--no-lora-freeze-a)
    bias+ffa          biases + LoRA B, lora_A frozen (the private bias+lora default)

Measure: held-out perplexity after training on the windows of HELD_DOCUMENTS held-out
speeches (the same windows for every arm and seed), paired by seed (the seed sets the LoRA
initialisation, the same in both LoRA arms; sampling and noise are fresh OS draws).

Criterion, fixed before the runs (commit before the first run finished): the FFA default
stands for causal LMs if the mean over seeds of perplexity(bias+ffa) - perplexity(bias+lora),
paired by seed, is <= 0; otherwise the default is limited to classification and the causal
LM trains both matrices.

Each run is one JSON line in results/causal_lm_ffa.jsonl (runs already there are skipped, so
a stopped run resumes); results/causal_lm_ffa.md is rendered from it. CPU budget: about
5 CPU-minutes a run at the default size, 9 runs (3 arms x 3 seeds), one thread each.

    nice -n 10 python benchmarks/causal_lm_ffa.py run --seeds 0 1 2 [--arms ...]
    python benchmarks/causal_lm_ffa.py report
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

from causal_lm_lr import MAX_LENGTH, cpu_s, prepare_speeches, recorded
from harness.records import append_jsonl, read_jsonl
from harness.render import write_between_markers
from harness.stats import t_interval

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # this checkout's dpfit
RESULTS = HERE / "results"
OUT = RESULTS / "causal_lm_ffa"
DOC_MARKERS = ("<!-- causal_lm_ffa:begin -->", "<!-- causal_lm_ffa:end -->")
# mode and lora_freeze_a of each arm
ARMS = {
    "bias": ("bias", None),
    "bias+lora": ("bias+lora", False),
    "bias+ffa": ("bias+lora", True),
}
BATCH = 8  # windows per logical step (expected size under Poisson sampling)
STEPS = 24
HELD_DOCUMENTS = 12  # held-out speeches scored (all their 256-token windows)
EPSILON = 8.0


def arm_lr(arm: str, steps: int) -> float:
    """The recipe's rate for a pretrained language model over `steps` steps."""
    from dpfit.recipe import LM_WALK, trained_lr

    return trained_lr(ARMS[arm][0], steps, LM_WALK)


def run(seeds: list[int], arms: list[str], steps: int, out: Path) -> None:
    from dpfit.train import train

    path = out.with_suffix(".jsonl")
    done = recorded(path, ("arm", "seed", "steps"))
    base, task, prep, pristine, _ = prepare_speeches(BATCH, steps, HELD_DOCUMENTS)
    base = dataclasses.replace(base, epsilon=EPSILON)
    for seed in seeds:
        for arm in arms:
            if (arm, seed, steps) in done:
                continue
            mode, freeze_a = ARMS[arm]
            config = dataclasses.replace(
                base, seed=seed, mode=mode, lora_freeze_a=freeze_a, lr=arm_lr(arm, steps)
            )
            model = copy.deepcopy(pristine)
            t0 = cpu_s()
            result = train(config, prepared=dataclasses.replace(prep, model=model), task=task)
            m = result.metrics
            row = {
                "arm": arm,
                "seed": seed,
                "mode": mode,
                "lora_freeze_a": m["config"].get("lora_freeze_a"),
                "trainable_params": m.get("trainable_params"),
                "lr": m["lr"],
                "steps": m["steps"],
                "batch": BATCH,
                "max_length": MAX_LENGTH,
                "perplexity_before": m["perplexity_before"],
                "perplexity_after": m["perplexity_after"],
                "eval_windows": m["eval_n"],
                "train_windows": m["train_examples"],
                "epsilon": m["epsilon"],
                "noise_multiplier": m["noise_multiplier"],
                "sample_rate": m.get("sample_rate"),
                "delta": m.get("delta"),
                "cpu_s": cpu_s() - t0,
                "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "command": (
                    f"nice -n 10 python benchmarks/causal_lm_ffa.py run --seeds {seed} "
                    f"--arms {arm} --steps {steps}"
                ),
            }
            print(json.dumps(row), flush=True)
            append_jsonl(path, row)
            del model, result


def paired(rows: list[dict], a: str, b: str) -> tuple[list[float], float, float] | None:
    """Per-seed perplexity(a) - perplexity(b) over the seeds both ran, its mean and the 95%
    t half-width (nan with one seed)."""
    by = {(r["arm"], r["seed"]): r["perplexity_after"] for r in rows}
    seeds = sorted({s for (arm, s) in by if arm == a} & {s for (arm, s) in by if arm == b})
    if not seeds:
        return None
    d = [by[(a, s)] - by[(b, s)] for s in seeds]
    ci = t_interval(d)
    return d, statistics.mean(d), (ci[1] - ci[0]) / 2 if ci else float("nan")


def verdict(rows: list[dict]) -> str | None:
    """The criterion: the FFA default stands if FFA's paired mean perplexity is <= A-trained's."""
    p = paired(rows, "bias+ffa", "bias+lora")
    if p is None or len(p[0]) < 3:
        return None
    return "stands" if p[1] <= 0 else "limited to classification"


def render(rows: list[dict]) -> str:
    first = rows[0]
    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    lines = [
        "# Private bias+LoRA on a causal LM: FFA-LoRA against training both matrices",
        "",
        "Produced by `nice -n 10 python benchmarks/causal_lm_ffa.py run --seeds ...` (each "
        "row's own command in causal_lm_ffa.jsonl) and `python benchmarks/causal_lm_ffa.py "
        "report`.",
        "",
        f"Bundled SmolLM2-135M with biases added, bundled convention speeches in "
        f"{first['max_length']}-token windows ({first['train_windows']} training windows, "
        f"privacy unit: window; {first['eval_windows']} held-out windows of {HELD_DOCUMENTS} "
        f"held-out speeches), logical batch {first['batch']} (Poisson), {first['steps']} "
        f"steps, eps {first['epsilon']:.2f} (noise multiplier "
        f"{first['noise_multiplier']:.3f}), AdamW at the recipe's rate for a pretrained LM "
        "over these steps, automatic clipping, dropout off. Held-out perplexity before "
        f"training: {first['perplexity_before']:.3f}. One torch thread a run.",
        "",
        "| arm | lr | seeds | held-out perplexity after (mean ± sd) | per seed | CPU s (mean) |",
        "|---|---|---|---|---|---|",
    ]
    for a in arms:
        rs = sorted((r for r in rows if r["arm"] == a), key=lambda r: r["seed"])
        ppl = [r["perplexity_after"] for r in rs]
        sd = f" ± {statistics.stdev(ppl):.3f}" if len(ppl) > 1 else ""
        lines.append(
            f"| {a} | {rs[0]['lr']:.3g} | {len(rs)} | {statistics.mean(ppl):.3f}{sd} | "
            + ", ".join(f"{p:.3f}" for p in ppl)
            + f" | {statistics.mean(r['cpu_s'] for r in rs):.0f} |"
        )
    lines += ["", "Paired by seed (lower is better):", ""]
    for a, b in (("bias+ffa", "bias+lora"), ("bias+ffa", "bias"), ("bias+lora", "bias")):
        p = paired(rows, a, b)
        if p is None:
            continue
        d, mean, half = p
        ci = f" [{mean - half:+.3f}, {mean + half:+.3f}]" if half == half else ""
        lines.append(
            f"- {a} - {b}: {mean:+.3f}{ci} (95% t, {len(d)} seeds; per seed "
            + ", ".join(f"{x:+.3f}" for x in d)
            + ")"
        )
    v = verdict(rows)
    lines += [
        "",
        "Criterion (fixed before the runs): the FFA default stands for causal LMs if the "
        "paired mean of perplexity(bias+ffa) - perplexity(bias+lora) is <= 0 over at least "
        f"3 seeds. Verdict: {v or 'not decided (fewer than 3 paired seeds)'}.",
        "",
    ]
    return "\n".join(lines)


def doc_block(rows: list[dict]) -> str:
    """docs/bias_lora.md's block: the table, the paired lines and the verdict."""
    md = render(rows)
    return md[md.index("| arm |") :].rstrip("\n")


def report(out: Path) -> None:
    rows = read_jsonl(out.with_suffix(".jsonl"))
    md = render(rows)
    out.with_suffix(".md").write_text(md)
    print(md)
    if out == OUT:  # the committed runs only
        write_between_markers(HERE.parent / "docs" / "bias_lora.md", DOC_MARKERS, doc_block(rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("run", "report"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if args.what == "run":
        run(args.seeds, args.arms, args.steps, Path(args.out))
    report(Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Which learning rate lets DP-BiTFiT-Add lower a pretrained causal LM's held-out perplexity?

One question, asked cheaply: the bundled SmolLM2-135M on the bundled 2012 convention speeches
(the data of benchmarks/long_document_train.py) cut into 256-token windows, a few dozen
logical steps of a small batch (4 windows: CPU), each learning rate with the noise off (`noise_multiplier`
0: the optimiser alone, not private) and at epsilon 8. Held-out perplexity before and after
on the windows of a few held-out speeches (the same windows for every arm, so arms compare
paired). The model and data are prepared once; each arm trains a fresh copy of the model
through `dpfit.train.train` (the loop `dpfit train` runs), Adam as in the recipe.

Each arm is one JSON line in <out>.jsonl (arms already there are skipped, so a stopped run
resumes); <out>.md is rendered from it. CPU budget: about 20 CPU-minutes (2-3 per arm), one thread.

    nice -n 10 python benchmarks/causal_lm_lr.py run [--lrs 3e-5 1e-4 ...] [--steps 24]
    python benchmarks/causal_lm_lr.py report
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import resource
import sys
from pathlib import Path

from harness.records import append_jsonl, read_jsonl

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # this checkout's dpfit
RESULTS = HERE / "results"
OUT = RESULTS / "causal_lm_lr"
LRS = (3e-5, 1e-4, 3e-4, 1e-3, 5e-3)
ARMS = {"noise-free (not private)": {"noise_multiplier": 0.0}, "private, eps 8": {}}
MAX_LENGTH = 256
BATCH = 4  # windows per logical step (expected size under Poisson sampling)
STEPS = 12
HELD_DOCUMENTS = 6  # held-out speeches scored (all their 256-token windows)


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def recorded(path: Path, fields: tuple[str, ...]) -> set[tuple]:
    """The arms a results log already holds, keyed by `fields` (a stopped run resumes)."""
    return {tuple(r[f] for f in fields) for r in read_jsonl(path)}


def prepare_speeches(batch: int, steps: int, held_documents: int):
    """The bundled SmolLM2 (biases added) on the bundled speeches in MAX_LENGTH windows,
    prepared once, with the base config of every arm and a pristine copy of the model for
    each arm to train: (base, task, prepared, pristine model, prepare CPU s). One thread."""
    import torch

    from dpfit.tasks.causal_lm import CausalLMTask
    from dpfit.train import TrainConfig

    torch.set_num_threads(1)
    base = TrainConfig(
        task="causal-lm",
        data="convention-speeches",
        max_length=MAX_LENGTH,
        privacy_unit="window",
        batch_size=batch,
        physical_batch_size=batch,
        max_steps=steps,
        epsilon=8.0,
    )
    task = CausalLMTask(eval_examples=held_documents)
    t0 = cpu_s()
    prep = task.prepare(base)  # model loaded, biases added, held-out perplexity before
    return base, task, prep, copy.deepcopy(prep.model), cpu_s() - t0


def run(lrs: list[float], steps: int, arms: list[str], out: Path) -> None:
    from dpfit.train import train

    path = out.with_suffix(".jsonl")
    done = recorded(path, ("arm", "lr", "steps"))
    base, task, prep, pristine, prepare_cpu = prepare_speeches(BATCH, steps, HELD_DOCUMENTS)
    for lr in lrs:
        for arm in arms:
            extra = ARMS[arm]
            if (arm, lr, steps) in done:
                continue
            config = dataclasses.replace(base, lr=lr, **extra)
            model = copy.deepcopy(pristine)
            t0 = cpu_s()
            result = train(config, prepared=dataclasses.replace(prep, model=model), task=task)
            m = result.metrics
            row = {
                "arm": arm,
                "lr": lr,
                "steps": m["steps"],
                "batch": BATCH,
                "max_length": MAX_LENGTH,
                "perplexity_before": m["perplexity_before"],
                "perplexity_after": m["perplexity_after"],
                "eval_windows": m["eval_n"],
                "train_windows": m["train_examples"],
                "epsilon": m["epsilon"],
                "noise_multiplier": m["noise_multiplier"],
                "cpu_s": cpu_s() - t0,
                "prepare_cpu_s": prepare_cpu,
                "command": (
                    f"nice -n 10 python benchmarks/causal_lm_lr.py run --lrs {lr:g} "
                    f"--steps {steps} --arms '{arm}'"
                ),
            }
            print(json.dumps(row), flush=True)
            append_jsonl(path, row)
            del model, result


def report(out: Path) -> None:
    rows = read_jsonl(out.with_suffix(".jsonl"))
    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    lrs = sorted({r["lr"] for r in rows})
    steps = sorted({r["steps"] for r in rows})
    first = rows[0]
    lines = [
        "# Causal-LM learning rate: held-out perplexity after DP-BiTFiT-Add (SmolLM2-135M)",
        "",
        f"Produced by `{first['command'].split(' --lrs')[0]} --lrs ... --steps ...` (each row's "
        "own command in the .jsonl) and `python benchmarks/causal_lm_lr.py report`.",
        "",
        f"Bundled convention speeches in {first['max_length']}-token windows "
        f"({first['train_windows']} training windows, privacy unit: window; "
        f"{first['eval_windows']} held-out windows of {HELD_DOCUMENTS} held-out speeches), "
        f"logical batch {first['batch']}, AdamW, automatic clipping, constant rate; "
        f"held-out perplexity before training: {first['perplexity_before']:.3f}.",
        "",
    ]
    for s in steps:
        lines += [
            f"Held-out perplexity after {s} logical steps (before: "
            f"{first['perplexity_before']:.3f})",
            "",
            "| lr | " + " | ".join(arms) + " |",
            "|---|" + "---|" * len(arms),
        ]
        for lr in lrs:
            cells = []
            for a in arms:
                hit = [r for r in rows if r["arm"] == a and r["lr"] == lr and r["steps"] == s]
                cells.append(f"{hit[-1]['perplexity_after']:.3f}" if hit else "-")
            lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
        lines.append("")
    private = [r for r in rows if r["noise_multiplier"] > 0]
    if private:
        lines.append(
            f"Private arms: epsilon {private[0]['epsilon']:.2f} (add-remove), noise multiplier "
            f"{private[0]['noise_multiplier']:.3f}."
        )
    from dpfit.recipe import resolve_recipe

    n = first["train_windows"]
    rule = resolve_recipe(n, 0, 8.0, None, 1)  # the lr rule reads n, classes, mode only
    steps_rule = rule.epochs * round(n / rule.batch_size)
    lines += [
        f"The recipe's rate for this data on its own schedule (n = {n} windows, logical batch "
        f"{rule.batch_size}, {steps_rule} steps): lr {rule.lr:.2g} ({rule.rule}).",
        "",
    ]
    cpu = sum(r["cpu_s"] for r in rows)
    lines += [
        f"CPU time of the arms (one thread, training and scoring; model loading and the "
        f"before-score not counted): {cpu / 60:.1f} minutes.",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("run", "report"))
    ap.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    if args.what == "run":
        run(args.lrs, args.steps, args.arms, Path(args.out))
    report(Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

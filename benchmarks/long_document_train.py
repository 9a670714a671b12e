"""Does `dpfit train` train the bundled SmolLM2-135M end to end on whole long documents?

The documented command (FLAGS below: 2,048-token windows of the bundled 2012 convention
speeches, each speech one privacy unit, activation checkpointing, a few Poisson steps) run as
a user would run it, in a subprocess; then the same command with the noise off
(`--noise-multiplier 0`, not private), the control that tells noise from a broken path when
the perplexity moves. Each run's metrics.json is kept whole in <out>.json and summarised in
<out>.md (held-out perplexity before and after, epsilon, unit, steps, peak RSS), with the
commands, so the figures in docs/long_documents.md come from here. Each finished run is kept
in <out>.partial.json until both are done, so a stopped run resumes where it was. CPU budget:
about 20 CPU-minutes in all, one thread, under `nice -n 10`.

`--config 4096x4` is the same at 4,096-token windows with physical batch 4, the (length,
physical batch) where both DP full arms of benchmarks/long_context.py failed to allocate under
the memory cap, every physical batch padded to 4,096 tokens (`--pad-to-max-length`: few
speeches fill a window, and a batch is otherwise as long as its longest window); it runs the private command first and the control only if the CPU budget
allows (several CPU-minutes per step), and has its own <out> and its own block in the docs.

    nice -n 10 python benchmarks/long_document_train.py [--config 2048] [--out PATH]
    python benchmarks/long_document_train.py --render   # <out>.md again from <out>.json
    python benchmarks/long_document_train.py --stopped  # <out>.json/.md from the runs finished
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness.render import write_between_markers  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs" / "long_documents.md"
CONTROL = "noise-free control (not private)"
RUNS = {  # name -> flags added to the config's flags (the control replaces the target epsilon)
    "private": "",
    CONTROL: " --noise-multiplier 0",
}


@dataclass(frozen=True)
class Config:
    """One documented command: its flags, where its results go, and its block in the docs."""

    flags: str
    order: tuple[str, ...]  # the runs in the order they run; each is saved before the next
    out: Path  # the committed result; only this <out> writes the docs block
    markers: tuple[str, str]
    title: str  # the md's heading, after "`dpfit train` on long documents: SmolLM2-135M, "
    produced_by: str
    # the data's shape at this length (which documents fill a window), in the md and docs:
    # where few documents reach the window, whether the steps ran at that length is a chance
    data_profile: bool = False


CONFIGS = {
    "2048": Config(
        flags=(
            "--task causal-lm --data convention-speeches --max-length 2048 --privacy-unit "
            "document --activation-checkpointing --batch-size 4 --physical-batch-size 1 "
            "--max-steps 4 --epsilon 8"
        ),
        # the control first: it tells the step size from the noise
        order=(CONTROL, "private"),
        out=RESULTS / "long_document_train",
        markers=("<!-- long_document_train: begin -->", "<!-- long_document_train: end -->"),
        title="2,048-token windows",
        produced_by="nice -n 10 python benchmarks/long_document_train.py",
    ),
    "4096x4": Config(
        flags=(
            "--task causal-lm --data convention-speeches --max-length 4096 --privacy-unit "
            "document --activation-checkpointing --pad-to-max-length --batch-size 4 "
            "--physical-batch-size 4 --max-steps 4 --epsilon 8"
        ),
        # the private run first: it is the result; the control only if the budget allows
        order=("private", CONTROL),
        out=RESULTS / "long_document_train_4096",
        markers=(
            "<!-- long_document_train_4096: begin -->",
            "<!-- long_document_train_4096: end -->",
        ),
        title="4,096-token windows, physical batch 4",
        produced_by="nice -n 15 python benchmarks/long_document_train.py --config 4096x4",
        data_profile=True,
    ),
}
DEFAULT_CONFIG = "2048"
# the default configuration's names, as before the configurations
FLAGS = CONFIGS[DEFAULT_CONFIG].flags
ORDER = CONFIGS[DEFAULT_CONFIG].order
DEFAULT_OUT = CONFIGS[DEFAULT_CONFIG].out
DOC_MARKERS = CONFIGS[DEFAULT_CONFIG].markers
QUIET = " --threads 1 --quiet"  # compute only: not part of the command the docs show


def _run(flags: str, folder: Path) -> tuple[dict, float]:
    """`dpfit train FLAGS --output FOLDER` in a subprocess; (its metrics.json, seconds)."""
    argv = ["train", *shlex.split(flags + QUIET), "--output", str(folder)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "dpfit", *argv], env=env, cwd=ROOT, text=True, capture_output=True
    )
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(done.returncode)
    return json.loads((folder / "metrics.json").read_text()), time.perf_counter() - t0


def _rows(m: dict) -> list[tuple[str, str]]:
    eps = m["epsilon"]  # metrics.json writes an infinite epsilon as "inf"
    eps = f"{eps:.3f}" if isinstance(eps, float) and eps < float("inf") else "inf (not private)"
    return [
        ("held-out perplexity before", f"{m['perplexity_before']:.2f}"),
        ("held-out perplexity after", f"{m['perplexity_after']:.2f}"),
        ("privacy unit", str(m["privacy_unit"])),
        ("epsilon (add-remove), delta", f"{eps}, {m['delta']:.3g}"),
        ("noise multiplier", f"{m['noise_multiplier']:.4f}"),
        ("sample rate (documents)", f"{m['sample_rate']:.4f}"),
        ("logical steps", str(m["steps"])),
        ("learning rate (the recipe's, AdamW)", f"{m['lr']:.3g}"),
        ("training documents", str(m["train_documents"])),
        ("window length, stride", f"{m['window_length']}, {m['stride']}"),
        ("held-out windows", str(m["eval_n"])),
        ("trainable biases", f"{m['trainable_params']:,}"),
        ("peak RSS", f"{m['peak_memory_mb']:.0f} MB"),
        ("wall time", f"{m['wall_time_s']:.0f} s"),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--config",
        choices=sorted(CONFIGS),
        default=DEFAULT_CONFIG,
        help="which documented command: 2048 (physical batch 1) or 4096x4",
    )
    ap.add_argument("--out", default=None, help="default: the config's committed result")
    ap.add_argument("--render", action="store_true", help="only write <out>.md from <out>.json")
    ap.add_argument(
        "--stopped", action="store_true", help="write <out>.json/.md from the runs finished"
    )
    args = ap.parse_args(argv)
    config = CONFIGS[args.config]
    out = Path(args.out) if args.out is not None else config.out
    if args.render:
        return _render(json.loads(out.with_suffix(".json").read_text()), out, config)
    flags = config.flags
    partial = out.with_suffix(".partial.json")  # runs finished so far, of these flags
    runs = json.loads(partial.read_text()) if partial.exists() else {}
    runs = {k: v for k, v in runs.items() if v["command"] == f"dpfit train {flags}{RUNS[k]}"}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dpfit-long-") as tmp:
        for i, name in enumerate(n for n in config.order if n not in runs and not args.stopped):
            metrics, seconds = _run(flags + RUNS[name], Path(tmp) / f"run{i}")
            runs[name] = {
                "command": f"dpfit train {flags}{RUNS[name]}",
                "subprocess_seconds": seconds,
                "metrics": metrics,
            }
            partial.write_text(json.dumps(runs, indent=2) + "\n")
    record = {
        "question": __doc__.splitlines()[0],
        "produced_by": config.produced_by,
        "compute_flags": QUIET.strip(),
        "runs": {name: runs[name] for name in RUNS if name in runs},
        "not_run": [name for name in RUNS if name not in runs],  # stopped (--stopped)
    }
    if config.data_profile and runs:
        record["data"] = data_profile(config.flags, list(runs.values()))
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    if not record["not_run"]:  # a stopped run keeps its partial result, to resume
        partial.unlink(missing_ok=True)
    return _render(record, out, config)


def data_profile(flags: str, runs: list[dict]) -> dict:
    """The run's documents at its window length, from dpfit train's own reading, split and
    windows, computed again here: a run does not record which documents its Poisson steps
    drew, and a physical batch is only as long as its longest window, so this says how many
    documents can make a step run at the full length, and the chance that the steps drew one."""
    from transformers import AutoTokenizer

    from dpfit.causal_lm import document_ids
    from dpfit.data.bundled import TextExample, split_by_group
    from dpfit.data.smollm import smollm2_folder
    from dpfit.tasks.causal_lm import HELD_OUT_DOCUMENTS, CausalLMTask, read_documents
    from dpfit.windows import windows

    words = shlex.split(flags)
    option = {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("--")}
    length = int(option["--max-length"])
    data = argparse.Namespace(
        data=option["--data"], text_column="text", privacy_unit="document", user_column=None
    )
    texts, groups, _ = read_documents(data)
    examples = [TextExample(t, 0, g) for t, g in zip(texts, groups, strict=True)]
    train, held = split_by_group(examples, (1 - HELD_OUT_DOCUMENTS, HELD_OUT_DOCUMENTS), seed=0)
    held = held[: CausalLMTask.eval_examples]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    train_tokens = [len(document_ids(d.text, tokenizer)) for d in train]
    held_windows = [w for d in held for w in windows(document_ids(d.text, tokenizer), length)]
    metrics = runs[0]["metrics"]
    for run in runs:  # the same documents as the runs read, or this says nothing about them
        m = run["metrics"]
        if (m["train_documents"], m["eval_n"]) != (len(train), len(held_windows)):
            raise SystemExit(
                f"the data profile has {len(train)} training documents and "
                f"{len(held_windows)} held-out windows, the run {m['train_documents']} and "
                f"{m['eval_n']}: the profile no longer reads the data as dpfit train does"
            )
    full = sum(n >= length for n in train_tokens)
    q, steps = metrics["sample_rate"], metrics["steps"]
    return {
        "window_length": length,
        "train_documents": len(train),
        "full_window_documents": full,
        "longest_train_document_tokens": max(train_tokens),
        "sample_rate": q,
        "steps": steps,
        "chance_a_step_drew_a_full_window": 1 - (1 - q) ** full,
        "chance_the_steps_drew_a_full_window": 1 - (1 - q) ** (full * steps),
        "held_out_windows": len(held_windows),
        "longest_held_out_window_tokens": max(len(w.ids) for w in held_windows),
    }


def _profile_lines(data: dict) -> list[str]:
    """The data's shape at the window length, as a second table of the md."""
    length = data["window_length"]
    return [
        f"Documents at {length:,}-token windows (dpfit train's split and windows of the same "
        "data, computed again by the script: a run does not record which documents its "
        "Poisson steps drew; without --pad-to-max-length a physical batch is as long as its "
        "longest window, so these are the chances that a step ran at the full length; with "
        "it, every step did):",
        "",
        "| the data at this window length | |",
        "|---|---|",
        f"| training documents with a full {length}-token window | "
        f"{data['full_window_documents']} of {data['train_documents']} |",
        f"| longest training document | {data['longest_train_document_tokens']} tokens |",
        f"| chance that one Poisson step (q = {data['sample_rate']:.4f}) drew one of them | "
        f"{data['chance_a_step_drew_a_full_window']:.0%} |",
        f"| chance that the {data['steps']} steps drew at least one | "
        f"{data['chance_the_steps_drew_a_full_window']:.0%} |",
        f"| longest held-out window (of {data['held_out_windows']}) | "
        f"{data['longest_held_out_window_tokens']} tokens |",
        "",
    ]


def _render(record: dict, out: Path, config: Config) -> int:
    """<out>.md: the runs side by side, with their commands."""
    runs = record["runs"]
    if not runs:
        raise SystemExit(f"no run of {out} has finished: nothing to render")
    names = list(runs)
    table = {name: dict(_rows(r["metrics"])) for name, r in runs.items()}
    lines = [
        f"# `dpfit train` on long documents: SmolLM2-135M, {config.title}",
        "",
        f"Produced by `{record['produced_by']}` (each run with `{record['compute_flags']}`):",
        "",
        *[f"* {name}: `{r['command']}`" for name, r in runs.items()],
        *[
            f"* {name}: not run (stopped for the CPU budget on a shared machine): "
            f"`dpfit train {config.flags}{RUNS[name]}`"
            for name in record.get("not_run", [])
        ],
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
        *[
            f"| {key} | " + " | ".join(table[n][key] for n in names) + " |"
            for key in table[names[0]]
        ],
        "",
        *(_profile_lines(record["data"]) if "data" in record else []),
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    if out.resolve() == config.out.resolve():  # the committed result: its table in the docs
        write_between_markers(DOCS, config.markers, docs_table(lines))
    print("\n".join(lines))
    return 0


def docs_table(md_lines: list[str]) -> str:
    """The md's table, as docs/long_documents.md quotes it, after the runs not run if any
    (so the docs say so too, not only the md)."""
    not_run = [line for line in md_lines if line.startswith("* ") and ": not run (" in line]
    tables, previous = [], ""
    for line in md_lines:
        if line.startswith("|"):
            if not previous.startswith("|") and tables:  # a second table: a blank line first
                tables.append("")
            tables.append(line)
        previous = line
    return "\n".join([*not_run, ""] + tables if not_run else tables)


if __name__ == "__main__":
    raise SystemExit(main())

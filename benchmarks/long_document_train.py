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

    nice -n 10 python benchmarks/long_document_train.py [--out benchmarks/results/long_document_train]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from doc_block import write_between_markers  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "long_document_train"
DOCS = ROOT / "docs" / "long_documents.md"
DOC_MARKERS = ("<!-- long_document_train: begin -->", "<!-- long_document_train: end -->")

FLAGS = (
    "--task causal-lm --data convention-speeches --max-length 2048 --privacy-unit document "
    "--activation-checkpointing --batch-size 4 --physical-batch-size 1 --max-steps 4 "
    "--epsilon 8"
)
RUNS = {  # name -> flags added to FLAGS (the control replaces the target epsilon)
    "private": "",
    "noise-free control (not private)": " --noise-multiplier 0",
}
ORDER = ("noise-free control (not private)", "private")  # the control first: it tells the
# step size from the noise, and each finished run is saved before the next starts
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
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--render", action="store_true", help="only write <out>.md from <out>.json")
    ap.add_argument(
        "--stopped", action="store_true", help="write <out>.json/.md from the runs finished"
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.render:
        return _render(json.loads(out.with_suffix(".json").read_text()), out)
    partial = out.with_suffix(".partial.json")  # runs finished so far, of these FLAGS
    runs = json.loads(partial.read_text()) if partial.exists() else {}
    runs = {k: v for k, v in runs.items() if v["command"] == f"dpfit train {FLAGS}{RUNS[k]}"}
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dpfit-long-") as tmp:
        for i, name in enumerate(n for n in ORDER if n not in runs and not args.stopped):
            metrics, seconds = _run(FLAGS + RUNS[name], Path(tmp) / f"run{i}")
            runs[name] = {
                "command": f"dpfit train {FLAGS}{RUNS[name]}",
                "subprocess_seconds": seconds,
                "metrics": metrics,
            }
            partial.write_text(json.dumps(runs, indent=2) + "\n")
    record = {
        "question": __doc__.splitlines()[0],
        "produced_by": "nice -n 10 python benchmarks/long_document_train.py",
        "compute_flags": QUIET.strip(),
        "runs": {name: runs[name] for name in RUNS if name in runs},
        "not_run": [name for name in RUNS if name not in runs],  # stopped (--stopped)
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    if not record["not_run"]:  # a stopped run keeps its partial result, to resume
        partial.unlink(missing_ok=True)
    return _render(record, out)


def _render(record: dict, out: Path) -> int:
    """<out>.md: the runs side by side, with their commands."""
    runs = record["runs"]
    names = list(runs)
    table = {name: dict(_rows(r["metrics"])) for name, r in runs.items()}
    lines = [
        "# `dpfit train` on long documents: SmolLM2-135M, 2,048-token windows",
        "",
        f"Produced by `{record['produced_by']}` (each run with `{record['compute_flags']}`):",
        "",
        *[f"* {name}: `{r['command']}`" for name, r in runs.items()],
        *[
            f"* {name}: not run (stopped for the CPU budget on a shared machine): "
            f"`dpfit train {FLAGS}{RUNS[name]}`"
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
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    if out.resolve() == DEFAULT_OUT.resolve():  # the committed result: its table in the docs
        write_between_markers(DOCS, DOC_MARKERS, docs_table(lines))
    print("\n".join(lines))
    return 0


def docs_table(md_lines: list[str]) -> str:
    """The md's table, as docs/long_documents.md quotes it."""
    return "\n".join(line for line in md_lines if line.startswith("|"))


if __name__ == "__main__":
    raise SystemExit(main())

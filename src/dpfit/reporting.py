"""Run artefacts: metrics.json, the per-step CSV, PNG plots, and the end-of-run table.

Files are written to a temporary name and renamed, so a run killed while reporting never
leaves a truncated metrics.json that a script would then read as the result.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# A private run's per-step file holds only what the release already makes public: the step,
# its epoch and the privacy spent after it (a function of the step count alone). The exact
# training loss and the exact Poisson batch size of a step are functions of the private batch
# that no noise covers, and so is its duration: a noise-only step (an empty Poisson batch) is
# taken in the same call as the next one and a step's time tracks its batch size. None of
# them is kept; the run's total time is (metrics.json). See docs/threat-model.md.
PRIVATE_STEP_FIELDS = ("step", "epoch", "epsilon")
NON_PRIVATE_STEP_FIELDS = ("step", "epoch", "loss", "elapsed_s")


@dataclass(frozen=True)
class StepRow:
    """One logical step: what the progress bar shows and the CSV keeps.

    `loss` and `elapsed_s` (seconds since the loop started) are kept for non-private runs and
    are None for private ones (see PRIVATE_STEP_FIELDS).
    """

    step: int
    epoch: int
    epsilon: float
    elapsed_s: float | None = None
    loss: float | None = None


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def to_json(obj: Mapping, indent: int | None = 2) -> str:
    return json.dumps(_json_safe(obj), indent=indent, sort_keys=False)


def write_json(path: str | Path, obj: Mapping) -> None:
    atomic_write_bytes(path, (to_json(obj) + "\n").encode())


def step_fields(private: bool) -> tuple[str, ...]:
    return PRIVATE_STEP_FIELDS if private else NON_PRIVATE_STEP_FIELDS


def write_steps_csv(path: str | Path, rows: Iterable[StepRow], private: bool) -> None:
    fields = step_fields(private)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow(asdict(r))
    atomic_write_bytes(path, buf.getvalue().encode())


def read_steps_csv(path: str | Path) -> list[StepRow]:
    with open(path, newline="") as f:
        return [
            StepRow(
                step=int(r["step"]),
                epoch=int(r["epoch"]),
                epsilon=float(r.get("epsilon") or "inf"),
                elapsed_s=float(r["elapsed_s"]) if r.get("elapsed_s") else None,
                loss=float(r["loss"]) if r.get("loss") not in (None, "") else None,
            )
            for r in csv.DictReader(f)
        ]


def plot_steps(
    rows: Sequence[StepRow], out_dir: str | Path, phases: Sequence[Mapping] = ()
) -> list[Path]:
    """epsilon.png (private runs) or loss.png (non-private runs) over logical steps.

    The epsilon axis starts at 0, and `phases` (metrics.json's epsilon_by_phase) mark each
    phase's share: a head-first phase, which runs before step 1, as a band up to what it
    spent; a full -> bias switch as a dashed line. A private run has no per-step training
    loss to plot (see PRIVATE_STEP_FIELDS). Needs matplotlib (skipped if absent).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; skipping plots (pip install matplotlib)")
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r.step for r in rows]
    written = []
    for field, ylabel in (("loss", "training loss"), ("epsilon", "epsilon spent")):
        values = [getattr(r, field) for r in rows]
        if not any(v is not None and math.isfinite(v) for v in values):
            continue  # private run: no loss; non-private run: no epsilon
        fig, ax = plt.subplots(figsize=(5, 3.2))
        if field == "epsilon":
            _mark_phases(ax, phases)
            first = next((p for p in phases if p["phase"] == "head-first"), None)
            if first is not None:  # the line starts where the head-first phase ended
                steps, values = [0, *steps], [first["epsilon_after"], *values]
            ax.set_ylim(bottom=0, top=max(v for v in values if v is not None) * 1.08)
        ax.plot(steps, values, lw=1.5, label="total spent" if phases else None)
        ax.set_xlabel("logical step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if field == "epsilon" and phases:
            ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = out_dir / f"{field}.png"
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        os.replace(tmp, path)
        written.append(path)
    return written


def _mark_phases(ax, phases: Sequence[Mapping]) -> None:
    done = 0
    for i, p in enumerate(phases):
        if p["phase"] == "head-first":
            ax.axhspan(0, p["epsilon_after"], color="C1", alpha=0.15,
                       label=f"head-first ({p['steps']} steps): {p['epsilon_after']:.3g}")  # fmt: skip
            continue
        done += p["steps"]
        if i < len(phases) - 1:  # a switch to the next phase
            ax.axvline(done, color="C2", ls="--", lw=1,
                       label=f"{p['phase']} -> {phases[i + 1]['phase']}: {p['epsilon_after']:.3g}")  # fmt: skip


def format_value(value) -> str:
    if isinstance(value, float):
        if not math.isfinite(value):
            return "inf" if value > 0 else "n/a"
        if value == 0:
            return "0"
        if abs(value) < 1e-3 or abs(value) >= 1e5:
            return f"{value:.3g}"
        return f"{value:.4g}"
    if value is None:
        return "-"
    return str(value)


def _one_line(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\n", " \u23ce ").replace("\t", " ")


def format_table(rows: Sequence[tuple[str, object]], title: str | None = None) -> str:
    """A two-column plain-text table for the end of a run."""
    # one table line per row: a newline inside a cell (a generated sample) would break it
    cells = [(_one_line(k), _one_line(format_value(v))) for k, v in rows]
    w1 = max((len(k) for k, _ in cells), default=0)
    w2 = max((len(v) for _, v in cells), default=0)
    line = "+" + "-" * (w1 + 2) + "+" + "-" * (w2 + 2) + "+"
    out = []
    if title:
        out.append(title)
    out.append(line)
    out.extend(f"| {k:<{w1}} | {v:>{w2}} |" for k, v in cells)
    out.append(line)
    return "\n".join(out)


UNIT_WORDS = {
    "window": "window (each window one example: epsilon protects a window, not a document)",
    "document": "document (all its windows sampled and clipped as one)",
    "user": "user (all their rows sampled and clipped as one)",
}


def mechanism_rows(m: Mapping) -> list[tuple[str, object]]:
    """What a private run released under, for a result table; one place, so no task's table
    can drop the insecure-noise warning."""
    if not m.get("private", True):
        return [("epsilon", "non-private")]
    rel = m.get("neighbouring") or "add-remove"  # older records: add-remove
    rows: list[tuple[str, object]] = [(f"epsilon ({rel} neighbours)", m.get("epsilon"))]
    # the other relation's epsilon for the same run (docs/threat-model.md, "Neighbours")
    for other, key in (
        ("add-remove", "epsilon_add_remove"),
        ("replace-one", "epsilon_replace_one"),
    ):
        if other != rel and m.get(key) is not None:
            rows.append((f"epsilon ({other} neighbours)", m[key]))
    rows += [
        ("neighbouring relation", f"{rel} (--neighbouring; default add-remove)"),
        ("delta", m.get("delta")),
        ("sigma (noise multiplier)", m.get("noise_multiplier")),
        ("clip norm", m.get("max_grad_norm")),
        ("clipping", m.get("clipping")),
    ]
    unit = m.get("privacy_unit")
    if unit in UNIT_WORDS:  # long documents: what one sampled and clipped contribution is
        rows.append(("privacy unit", UNIT_WORDS[unit]))
    if m.get("insecure_seed"):
        rows.append(("NOT PRIVATE against", "anyone who knows --seed (insecure noise)"))
    return rows


def score_rows(m: Mapping, labels: Mapping[str, str]) -> list[tuple[str, object]]:
    """Optional accuracies (metrics key -> row label), only those the run recorded."""
    return [(label, f"{m[key]:.4f}") for key, label in labels.items() if m.get(key) is not None]


def peak_memory_mb(device: str = "cpu") -> float:
    """Peak memory of this run: CUDA allocator peak on GPU, process peak RSS on CPU."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    except (ImportError, AttributeError):  # pragma: no cover - non-POSIX
        return float("nan")

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

STEP_FIELDS = ("step", "epoch", "loss", "epsilon", "batch_size", "elapsed_s")


@dataclass(frozen=True)
class StepRow:
    """One logical step: what the progress bar shows and the CSV keeps."""

    step: int
    epoch: int
    loss: float
    epsilon: float
    batch_size: int
    elapsed_s: float


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


def write_steps_csv(path: str | Path, rows: Iterable[StepRow]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=STEP_FIELDS)
    writer.writeheader()
    for r in rows:
        writer.writerow(asdict(r))
    atomic_write_bytes(path, buf.getvalue().encode())


def read_steps_csv(path: str | Path) -> list[StepRow]:
    with open(path, newline="") as f:
        return [
            StepRow(
                int(r["step"]),
                int(r["epoch"]),
                float(r["loss"]),
                float(r["epsilon"]),
                int(r["batch_size"]),
                float(r["elapsed_s"]),
            )
            for r in csv.DictReader(f)
        ]


def plot_steps(rows: Sequence[StepRow], out_dir: str | Path) -> list[Path]:
    """loss.png and epsilon.png over logical steps; needs matplotlib (skipped if absent)."""
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
        if field == "epsilon" and not any(math.isfinite(v) for v in values):
            continue  # non-private run: nothing to plot
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot(steps, values, lw=1.5)
        ax.set_xlabel("logical step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / f"{field}.png"
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        os.replace(tmp, path)
        written.append(path)
    return written


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


def format_table(rows: Sequence[tuple[str, object]], title: str | None = None) -> str:
    """A two-column plain-text table for the end of a run."""
    cells = [(k, format_value(v)) for k, v in rows]
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

"""Per-example channel sums of a channels-first output gradient (conv, GroupNorm bias
samplers): torch's reduction over the trailing axes against the product with a ones vector
that `sum_to_channel` used above 2^20 elements before.

    PYTHONPATH=src python benchmarks/archive/channel_sums.py

resnet-gn's GroupNorm output gradients at batch 16 and 28, 56 and 112 pixels, float32, one
thread: the best and the median of 15 repeats of the mean of 20 calls, in microseconds.
Writes benchmarks/results/archive/channel_sums.{json,md}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]  # archived in benchmarks/archive/
sys.path.insert(0, str(BENCHMARKS))  # the harness and the scripts it borrows from

import torch  # noqa: E402
from harness.timing import best_and_median_us  # noqa: E402

RESULTS = BENCHMARKS / "results" / "archive"
# (channels, side) of resnet-gn's stages at input side S: (16, S), (32, S / 2), (64, S / 4)
SHAPES = [(16, 16, s, s) for s in (28, 56, 112)] + [(16, 32, 56, 56), (16, 64, 28, 28)]


def reduction(g: torch.Tensor) -> torch.Tensor:
    return g.sum((2, 3))


def product(g: torch.Tensor) -> torch.Tensor:
    b, c = g.shape[:2]
    positions = g.shape[2] * g.shape[3]
    return torch.matmul(g.view(b, c, positions), g.new_ones(positions))


def micros(fn, g: torch.Tensor) -> tuple[float, float]:
    """Best and median microseconds of one call of `fn(g)` (20 calls, 15 repeats)."""
    return best_and_median_us(lambda: fn(g), number=20, repeat=15)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for shape in SHAPES:
        g = torch.randn(shape)
        diff = (reduction(g).double() - g.double().sum((2, 3))).abs().max().item()
        best_r, med_r = micros(reduction, g)
        best_p, med_p = micros(product, g)
        rows.append({"shape": list(shape), "reduction_us": [best_r, med_r],
                     "product_us": [best_p, med_p], "reduction_max_abs_error": diff})  # fmt: skip
    load = os.getloadavg()[0]
    cmd = " ".join(["python benchmarks/archive/channel_sums.py", *sys.argv[1:]])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "channel_sums.json").write_text(
        json.dumps({"command": cmd, "load_average_1min": load, "rows": rows}, indent=2) + "\n"
    )
    lines = [
        "# Per-example channel sums: reduction vs product with ones", "",
        f"Output of `{cmd}` (one thread, float32, 1-minute load average {load:.1f}). "
        "Microseconds per call, best / median of 15 repeats of 20 calls.", "",
        "| gradient shape | reduction (best / median) | product (best / median) |",
        "|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        (br, mr), (bp, mp) = r["reduction_us"], r["product_us"]
        lines.append(f"| {' x '.join(map(str, r['shape']))} | {br:.0f} / {mr:.0f} | "
                     f"{bp:.0f} / {mp:.0f} |")  # fmt: skip
    (RESULTS / "channel_sums.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

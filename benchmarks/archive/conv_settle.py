"""Full mode's conv sampler, `conv_outer`, against `settle(conv_factors(...))`, the shared
ghost-or-materialise rule applied to the factored gradient: same results? time, tensor peak?

    PYTHONPATH=src python benchmarks/archive/conv_settle.py

Both routes on the resnet-gn conv shapes that full mode materialises (batch 16, 3 x 3 and 1 x 1
kernels), in float32 and bfloat16, one thread: bitwise equality of the per-example gradients,
the best of 7 repeats of the mean of 5 calls (ms), and the most tensor bytes live at once
during one call (torch profiler memory events). Writes benchmarks/results/archive/conv_settle.{json,md}.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]  # archived in benchmarks/archive/
sys.path.insert(0, str(BENCHMARKS))  # the harness and the scripts it borrows from

import torch  # noqa: E402
from harness.timing import best_ms  # noqa: E402
from torch import nn  # noqa: E402

from dpfit.grad_sample.full import conv_factors, conv_outer, settle  # noqa: E402
from dpfit.memory import tensor_peak  # noqa: E402

RESULTS = BENCHMARKS / "results" / "archive"
# (in channels, out channels, kernel, stride, input side)
SHAPES = [(1, 16, 3, 1, 112), (16, 16, 3, 1, 56), (16, 32, 3, 2, 112), (32, 64, 1, 2, 56),
          (16, 16, 3, 1, 28)]  # fmt: skip


def via_settle(layer: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return settle(conv_factors(layer, x, g, 0)["weight"])


def tensor_peak_mb(fn) -> float:
    return tensor_peak(fn) / 2**20


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for cin, cout, k, s, side in SHAPES:
            layer = nn.Conv2d(cin, cout, k, s, k // 2, bias=False).to(dtype)
            x = torch.randn(16, cin, side, side).to(dtype)
            out = (side + 2 * (k // 2) - k) // s + 1
            g = torch.randn(16, cout, out, out).to(dtype)
            own = functools.partial(conv_outer, layer, x, g, 0)
            shared = functools.partial(via_settle, layer, x, g)
            a, b = own()["weight"], shared()
            assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)  # materialised
            rows.append({
                "dtype": str(dtype).removeprefix("torch."), "conv": f"{cin}->{cout} k{k} s{s}",
                "input": side, "bitwise_equal": torch.equal(a, b),
                "conv_outer_ms": best_ms(own), "settle_ms": best_ms(shared),
                "conv_outer_peak_mb": tensor_peak_mb(own), "settle_peak_mb": tensor_peak_mb(shared),
            })  # fmt: skip
    load = os.getloadavg()[0]
    RESULTS.mkdir(exist_ok=True)
    cmd = " ".join(["python benchmarks/archive/conv_settle.py", *sys.argv[1:]])
    (RESULTS / "conv_settle.json").write_text(
        json.dumps({"command": cmd, "load_average_1min": load, "rows": rows}, indent=2) + "\n"
    )
    lines = [
        "# Full mode's conv sampler: its own rule vs settle(conv_factors(...))", "",
        f"Output of `{cmd}` (one thread, batch 16, 1-minute load average {load:.1f}). Time: "
        "best of 7 repeats of the mean of 5 calls. Peak: most tensor MB live at once in one "
        "call (torch profiler).", "",
        "| dtype | conv | input | bitwise equal | conv_outer ms | settle ms | conv_outer peak MB "
        "| settle peak MB |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['conv']} | {r['input']} | {r['bitwise_equal']} | "
                     f"{r['conv_outer_ms']:.2f} | {r['settle_ms']:.2f} | "
                     f"{r['conv_outer_peak_mb']:.1f} | {r['settle_peak_mb']:.1f} |")  # fmt: skip
    (RESULTS / "conv_settle.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

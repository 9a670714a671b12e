"""The compute precision of the forward and backward pass: float32, or bfloat16 autocast.

Under bf16 autocast the matrix products run in bfloat16 (oneDNN's AVX512-BF16/AMX kernels on
CPUs that advertise them), while everything the privacy guarantee rests on stays float32: the
trainable parameters are float32 masters (autocast casts a bf16 copy for each product), the
per-example gradients are summed over positions in float32 (dpfit.grad_sample.registry), and
their norms, clip factors, clipped sum and noise are float32 (dpfit.clipped_sum, dpfit.noise).
A bf16 norm is off by up to ~0.4%, enough to let a clipped contribution exceed R.

`auto` picks bf16 only where it is fast: a CPU whose flags include avx512_bf16 or amx_bf16
(without them oneDNN emulates bf16, slower than float32), or a CUDA device that reports
bf16 support.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import torch

from dpfit.errors import DPFitError

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "auto")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


class PrecisionError(DPFitError, ValueError):
    """A compute precision that this device cannot run."""


@functools.lru_cache(maxsize=1)
def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """The bf16 instruction flags this CPU advertises (empty where /proc/cpuinfo is absent:
    then `auto` keeps float32, the safe side)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return ()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.partition(":")[2].split())
            break  # every core lists the same flags
    return tuple(f for f in CPU_BF16_FLAGS if f in flags)


def bf16_is_fast(device: torch.device) -> bool:
    """Whether bf16 matrix products run natively on `device` (what `auto` asks)."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(cpu_bf16_flags())
    return False


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """The precision that runs: "fp32" or "bf16", for `precision` ("fp32", "bf16" or "auto") on `device`."""
    device = torch.device(device)
    if precision not in PRECISIONS:
        raise PrecisionError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "auto":
        return "bf16" if bf16_is_fast(device) else "fp32"
    if precision == "bf16" and device.type == "cuda" and not bf16_is_fast(device):
        raise PrecisionError(f"{device} does not support bfloat16; use --precision fp32 (or auto)")
    if precision == "bf16" and device.type == "cpu" and not bf16_is_fast(device):
        log.warning(
            "bf16 on a CPU without avx512_bf16/amx_bf16: oneDNN emulates it, which is usually "
            "slower than fp32; --precision auto would pick fp32 here"
        )
    return precision


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The context to run forward (and loss) in: bf16 autocast, or nothing for fp32.

    `precision` is resolved first ("auto" allowed). Run backward outside it, as torch
    recommends; the backward pass follows the forward's dtypes.
    """
    device = torch.device(device)
    if resolve_precision(precision, device) == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)

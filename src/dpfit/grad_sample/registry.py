"""Registry of per-example gradient samplers, keyed by layer type.

A *bias sampler* turns the gradient of a layer's output into per-example gradients of the
parameters that enter additively (biases): it needs nothing from the forward pass. A *weight
sampler* also needs the layer's input and is used only for parameters that are not biases
(a new classification head, or full fine-tuning).

Types from optional packages (transformers' Conv1D) are registered by qualified name so that
importing dpfit never imports them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# (module, grad_output, batch_dim) -> {param_name: per-example grad [B, *param.shape]}
BiasSampler = Callable[[nn.Module, torch.Tensor, int], dict[str, torch.Tensor]]
# (module, input, grad_output, batch_dim) -> {param_name: per-example grad}
WeightSampler = Callable[[nn.Module, torch.Tensor, torch.Tensor, int], dict[str, torch.Tensor]]
# For layers whose biases are applied inside one functional call (nn.MultiheadAttention):
# called after the layer's forward with (module, inputs, output, emit); it arranges, without
# caching anything, for `emit(param_name, per_example_grad)` to be called in the backward pass.
CaptureFactory = Callable[[nn.Module, tuple, Any, Callable[[str, torch.Tensor], None]], None]


@dataclass(frozen=True)
class SamplerEntry:
    bias: BiasSampler | None = None
    bias_params: tuple[str, ...] = ("bias",)
    weight: WeightSampler | None = None
    weight_params: tuple[str, ...] = ("weight",)
    # Layers whose batch axis is fixed by torch's own convention (conv, group norm: N first)
    # ignore the engine's batch_first setting.
    batch_axis_fixed: bool = False
    capture: CaptureFactory | None = None
    capture_params: tuple[str, ...] = ()


_REGISTRY: dict[type | str, SamplerEntry] = {}


def _key(layer: type | str) -> type | str:
    return layer


def register_bias_sampler(
    *layers: type | str, params: tuple[str, ...] = ("bias",), batch_axis_fixed: bool = False
) -> Callable[[BiasSampler], BiasSampler]:
    def deco(fn: BiasSampler) -> BiasSampler:
        for layer in layers:
            old = _REGISTRY.get(_key(layer), SamplerEntry())
            _REGISTRY[_key(layer)] = SamplerEntry(
                fn, params, old.weight, old.weight_params, batch_axis_fixed
            )
        return fn

    return deco


def register_weight_sampler(
    *layers: type | str, params: tuple[str, ...] = ("weight",)
) -> Callable[[WeightSampler], WeightSampler]:
    def deco(fn: WeightSampler) -> WeightSampler:
        for layer in layers:
            old = _REGISTRY.get(_key(layer), SamplerEntry())
            _REGISTRY[_key(layer)] = SamplerEntry(
                old.bias, old.bias_params, fn, params, old.batch_axis_fixed
            )
        return fn

    return deco


def register_capture(
    *layers: type | str, params: tuple[str, ...]
) -> Callable[[CaptureFactory], CaptureFactory]:
    """Register a capture for layers that own all the listed (possibly nested) parameters."""

    def deco(fn: CaptureFactory) -> CaptureFactory:
        for layer in layers:
            _REGISTRY[_key(layer)] = SamplerEntry(capture=fn, capture_params=params)
        return fn

    return deco


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def lookup(module: nn.Module) -> SamplerEntry | None:
    """The entry for the most specific registered class in the module's MRO."""
    for cls in type(module).__mro__:
        entry = _REGISTRY.get(cls) or _REGISTRY.get(_qualname(cls))
        if entry is not None:
            return entry
    return None


def registered_layers() -> list[str]:
    return sorted(k if isinstance(k, str) else _qualname(k) for k in _REGISTRY)


def move_batch_first(t: torch.Tensor, batch_dim: int) -> torch.Tensor:
    return t if batch_dim == 0 else t.movedim(batch_dim, 0)


# low-precision compute dtypes whose per-position sums are taken in float32: one bf16 rounding
# of a per-example bias gradient is ~0.4% (dpfit.precision)
HALF_DTYPES = (torch.bfloat16, torch.float16)

# below this many elements torch's reduction is as fast as the product (and cheaper to call)
MATMUL_SUM_MIN_NUMEL = 1 << 20

# A half-precision gradient whose float32 copy would exceed UPCAST_SLICE_ABOVE bytes is upcast
# and summed a few examples at a time (slices of about UPCAST_SLICE_BYTES): the copy then stays
# in cache. The same float32 sums, example by example; on CPU a (56, 128, 1536) bf16 gradient
# (44 MB as float32) took 24 ms upcast whole and 3 ms in slices, while below ~16 MB slicing
# only adds calls (benchmarks/archive/position_sums.py).
UPCAST_SLICE_ABOVE = 16 << 20
UPCAST_SLICE_BYTES = 1 << 20


def _matmul_sums(g: torch.Tensor) -> bool:
    """Whether a sum over positions may run as a product with a ones vector: a large
    contiguous gradient on CPU, float32 at full matmul precision or float64. There one BLAS pass
    reads it about twice as fast as torch's reduction over a middle axis (per-example sums of
    an MLP output in a BERT layer, 32 x 128 x 1536: 2.1 ms vs 4.3 ms), with the same float32
    accumulation. Elsewhere (GPU, where TF32 may be on; half precision) the plain reduction."""
    if g.numel() < MATMUL_SUM_MIN_NUMEL or g.device.type != "cpu" or not g.is_contiguous():
        return False
    if g.dtype == torch.float64:
        return True
    if g.dtype != torch.float32:
        return False
    try:
        return torch.get_float32_matmul_precision() == "highest"
    except RuntimeError:  # legacy and new precision settings mixed: take no chances
        return False


def sum_positions(g: torch.Tensor, batch_dim: int, kept: int = 1) -> torch.Tensor:
    """Per-example sums: `g` summed over every axis but `batch_dim` and its last `kept` axes,
    shaped (batch, *g.shape[-kept:])."""
    d = g.dim()
    b = batch_dim % d
    if d - kept == 1:  # no position axes
        return g
    if _matmul_sums(g):
        shape = g.shape
        rows = shape[b]
        lead = math.prod(shape[:b])  # positions before the batch axis (sequence-first)
        mid = math.prod(shape[b + 1 : d - kept])  # positions after it (batch-first)
        if lead == 1 or mid == 1:
            tail = shape[d - kept :]
            width = math.prod(tail)
            if lead == 1:  # (B, positions, width): ones(1, positions) @ each example's rows
                out = torch.matmul(g.new_ones(1, mid), g.view(rows, mid, width))
            else:  # (positions, B * width)
                out = g.new_ones(1, lead) @ g.view(lead, rows * width)
            return out.view(rows, *tail)
    dims = [i for i in range(d - kept) if i != b]
    if g.dtype in HALF_DTYPES:  # bf16 autocast: accumulate and return float32 (dpfit.precision)
        # an upcast, then a float32 reduction: the same float32 sums as sum(dtype=float32),
        # whose CPU kernel was slower than both ops together on every BERT-step shape tried
        return _float32_sums(g, b, dims)
    return g.sum(dim=dims)  # leaves (batch, *tail)


def _float32_sums(g: torch.Tensor, b: int, dims: list[int]) -> torch.Tensor:
    """Per-example float32 sums of a half-precision `g` over `dims`, batch axis `b`: upcast
    whole, or, for a large `g`, a slice of examples at a time (UPCAST_SLICE_ABOVE)."""
    rows, copy_bytes = g.shape[b], 4 * g.numel()  # the float32 copy's size
    if g.device.type != "cpu" or copy_bytes <= UPCAST_SLICE_ABOVE or rows < 2:
        return g.float().sum(dim=dims)
    step = max(1, UPCAST_SLICE_BYTES * rows // copy_bytes)  # examples per slice
    tail = [size for i, size in enumerate(g.shape) if i != b and i not in dims]
    out = g.new_empty((rows, *tail), dtype=torch.float32)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        torch.sum(g.narrow(b, start, n).float(), dim=dims, out=out.narrow(0, start, n))
    return out


def sum_to_channel(g: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """Sum every axis but 0 (batch) and `channel_dim` (after moving batch first).

    Channels first (conv, GroupNorm: (B, C, positions)), the positions are the contiguous
    trailing axes, which torch's reduction reads at full speed: on CPU it beat the product with
    a ones vector on every resnet-gn feature map tried (benchmarks/archive/channel_sums.py), so no
    product there (the product pays off for the middle-axis sums of `sum_positions`)."""
    c = channel_dim % g.dim()
    if c == g.dim() - 1:
        return sum_positions(g, 0, 1)
    dims = [d for d in range(1, g.dim()) if d != c]
    if not dims:
        return g
    if g.dtype in HALF_DTYPES:  # bf16 autocast: accumulate and return float32
        return g.sum(dim=dims, dtype=torch.float32)
    return g.sum(dim=dims)

"""bf16 copies of frozen matrix weights, cast once per run instead of once per product.

Autocast's cast cache keeps only leaf tensors that require grad, so under bf16 autocast every
frozen weight (bias-only training freezes them all) is cast to bf16 again on every call, in
every step. `FrozenWeightCasts` casts each frozen float32 weight of a matrix-product layer
(nn.Linear, nn.Conv1d/2d/3d, transformers' Conv1D) once and swaps the copy in for one step's
forward and backward pass (`active()`). The copy is the very tensor autocast would have made
(`weight.to(bfloat16)`, round to nearest even), so nothing that is computed changes; only the
repeated casts go.

What a caller can observe: inside `active()` those frozen weights hold bf16 data (the same
Parameter objects; their float32 values are put back on exit, also on an error), so run only
the autocast forward and its backward inside it. Outside it the model is float32 as given.
Trainable parameters (float32 masters) and weights that another, non-matmul module shares
(tied embeddings) are never touched. A frozen weight changed in place (its version counter
moves, or its storage is replaced) is cast again at the next `active()`, so one instance may
serve a whole run, phase after phase.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from dpfit.precision import DTYPES, resolve_precision

MATMUL_MODULES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
MATMUL_QUALNAMES = ("transformers.pytorch_utils.Conv1D",)  # GPT-2's x @ W + b (addmm)


def _is_matmul(module: nn.Module) -> bool:
    cls = type(module)
    return isinstance(module, MATMUL_MODULES) or (
        f"{cls.__module__}.{cls.__qualname__}" in MATMUL_QUALNAMES
    )


class FrozenWeightCasts:
    """Low-precision copies of `model`'s frozen matmul weights for bf16 runs (a no-op in fp32)."""

    def __init__(self, model: nn.Module, precision: str, device: torch.device | str) -> None:
        self.model = model
        resolved = precision if precision in DTYPES else resolve_precision(precision, device)
        self.dtype: torch.dtype | None = None if resolved == "fp32" else DTYPES[resolved]
        # weight -> ((its version, its storage) when cast, the low-precision copy)
        self._copies: dict[nn.Parameter, tuple[tuple[int, int], torch.Tensor]] = {}

    def frozen_weights(self) -> list[nn.Parameter]:
        """The float32 weights swapped in `active()`: frozen, of a matmul layer, and used by
        no other kind of module (a weight tied to an embedding must stay float32 there)."""
        matmul: dict[int, nn.Parameter] = {}
        elsewhere: set[int] = set()
        for module in self.model.modules():
            for name, p in module.named_parameters(recurse=False):
                if _is_matmul(module) and name == "weight":
                    matmul[id(p)] = p
                else:
                    elsewhere.add(id(p))
        return [
            p
            for key, p in matmul.items()
            if key not in elsewhere and not p.requires_grad and p.dtype == torch.float32
        ]

    def _copy(self, w: nn.Parameter) -> torch.Tensor:
        stamp = (w._version, w.data_ptr())
        hit = self._copies.get(w)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        low = w.detach().to(self.dtype)
        self._copies[w] = (stamp, low)
        return low

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run one step's autocast forward and its backward pass inside this."""
        if self.dtype is None:
            yield
            return
        weights = self.frozen_weights()
        stale = set(self._copies) - set(weights)  # unfrozen since: drop their copies
        for w in stale:
            del self._copies[w]
        masters: list[tuple[nn.Parameter, torch.Tensor]] = []
        try:
            for w in weights:
                low = self._copy(w)
                masters.append((w, w.data))
                w.data = low
            yield
        finally:
            for w, master in reversed(masters):
                w.data = master

"""One float32 buffer for all trainable parameters: the clipped sum lives there (float64
when a trainable parameter is float64, so a float64 model is clipped and summed in float64).

Clipping, noise and the distributed all-reduce then each run once over one tensor per step
instead of once per parameter: the fixed per-tensor cost (a few kernel launches and Python
calls each) is what dominates them for bias-only training, whose tensors are small.
"""

from __future__ import annotations

from itertools import accumulate

import torch
from torch import nn


class FlatLayout:
    """Where each trainable parameter's elements sit in the flat buffer (parameter order)."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = list(params)
        self.sizes = [p.numel() for p in self.params]
        self.offsets = [0, *accumulate(self.sizes)][:-1]
        self.numel = sum(self.sizes)
        # float32 for float32 and half-precision parameters (bf16 rows are summed in float32);
        # float64 when any parameter is, so that float64 training is not rounded to float32
        self.dtype = (
            torch.float64 if any(p.dtype == torch.float64 for p in self.params) else torch.float32
        )
        # a split piece of a 1-D parameter already has its shape: no view call for it
        self._flat = [p.dim() == 1 for p in self.params]
        self._position = {p: i for i, p in enumerate(self.params)}
        self._segments: dict[tuple[int, ...], torch.Tensor] = {}

    def position(self, p: nn.Parameter) -> int:
        return self._position[p]

    def span(self, p: nn.Parameter) -> slice:
        i = self._position[p]
        return slice(self.offsets[i], self.offsets[i] + self.sizes[i])

    def zeros(self) -> torch.Tensor:
        """A zero buffer on the parameters' device (read now: the model may have moved)."""
        device = self.params[0].device if self.params else None
        return torch.zeros(self.numel, dtype=self.dtype, device=device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat` cut into tensors shaped like the parameters (views, no copy)."""
        pieces = flat.split_with_sizes(self.sizes)  # (Tensor.split adds a Python layer)
        return [
            t if is_flat else t.view(p.shape)
            for t, p, is_flat in zip(pieces, self.params, self._flat, strict=True)
        ]

    def segment_ids(self, positions: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """For the parameters at `positions` laid end to end: each element's index in that
        list (to reduce a concatenation per parameter with one index_add_)."""
        key = positions
        ids = self._segments.get(key)
        if ids is None or ids.device != device:
            lengths = torch.tensor([self.sizes[i] for i in positions], device=device)
            ids = torch.repeat_interleave(torch.arange(len(positions), device=device), lengths)
            self._segments[key] = ids
        return ids

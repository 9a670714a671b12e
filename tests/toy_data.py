"""A small classification dataset shared by the sampling and distributed tests."""

from __future__ import annotations

import torch


class Points(torch.utils.data.Dataset):
    """x_i in R^4, y_i a class; item i also returns i so tests can see which examples were drawn."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 4, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], i

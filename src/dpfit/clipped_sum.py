"""One logical batch's sum of clipped per-example gradients, laid out flat (dpfit.flat).

Each physical batch's per-example gradients are arranged side by side (`arrange`), each
example's global norm is taken across every trainable parameter, its clip factor comes from the
clipping registry (dpfit.clipping), and the clipped rows are added to the running sum with one
matmul (`ClippedSum.clip_into`). The noise is added once to the finished sum by the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpfit.flat import FlatLayout
from dpfit.grad_sample.full import OuterGrad


@dataclass
class PhysicalBatch:
    """The per-example gradients of one physical batch, arranged for clipping.

    plain: parameters whose per-example gradients are dense, side by side in `dense`
    (rows, elements) in parameter order, not yet scaled; factored: those held as `OuterGrad`
    (full mode), whose norms and weighted sums come from their factors.
    """

    rows: int
    per_example: dict[nn.Parameter, Any]
    plain: list[nn.Parameter]
    factored: list[nn.Parameter]
    dense: torch.Tensor | None
    _sq_norms: dict[nn.Parameter, torch.Tensor] = field(default_factory=dict, repr=False)

    def factored_sq_norms(self, p: nn.Parameter) -> torch.Tensor:
        """Each example's squared gradient norm for a factored parameter, computed once per
        batch (the gradient check and the clipping both need it)."""
        sq = self._sq_norms.get(p)
        if sq is None:
            sq = self._sq_norms[p] = self.per_example[p].sq_norms()
        return sq


def arrange(
    per_example: dict[nn.Parameter, Any],
    params: list[nn.Parameter],
    rows: int,
    dtype: torch.dtype = torch.float32,
) -> PhysicalBatch:
    """Every plain per-example gradient side by side, in the flat layout's `dtype`: one norm,
    one clip, one matmul."""
    plain: list[nn.Parameter] = []
    factored: list[nn.Parameter] = []
    parts: list[torch.Tensor] = []
    get = per_example.get
    for p in params:
        g = get(p)
        if g is None:
            continue
        if isinstance(g, OuterGrad):  # full mode: kept factored
            factored.append(p)
        else:
            plain.append(p)
            parts.append(g.reshape(rows, -1))
    dense = torch.cat(parts, 1).to(dtype) if parts else None
    return PhysicalBatch(rows, per_example, plain, factored, dense)


class ClippedSum:
    """The running sum of clipped per-example gradients of the current logical batch."""

    def __init__(self, layout: FlatLayout) -> None:
        self.layout = layout
        # flat (layout.numel,) in layout.dtype; None until the logical batch's first physical batch
        self._sum: torch.Tensor | None = None

    @property
    def started(self) -> bool:
        """Whether anything was added since the last `take()`."""
        return self._sum is not None

    def clip_into(
        self,
        batch: PhysicalBatch,
        clip_fn: Callable[[torch.Tensor, float], torch.Tensor],
        max_grad_norm: float,
        scale: float,
    ) -> None:
        """Scale each example of `batch` by its clip factor (to norm `max_grad_norm` at most)
        and add it to the sum.

        scale: the loss scale of each row (the batch size for a mean loss); it multiplies each
        example's norm and its row, so it is applied to the n norms and n factors, not to every
        element of the per-example matrix.
        """
        n, per_ex, dense = batch.rows, batch.per_example, batch.dense
        plain, factored = batch.plain, batch.factored
        if dense is not None:
            sq = dense.pow(2).sum(1) * scale**2
        else:
            sq = torch.zeros(n, dtype=self.layout.dtype, device=per_ex[factored[0]].device)
        for p in factored:  # full mode: norm from Gram matrices, sum by book-keeping
            sq = sq + batch.factored_sq_norms(p).to(sq.device) * scale**2
        factors = clip_fn(sq.sqrt(), max_grad_norm)
        if dense is not None:
            clipped = (factors * scale) @ dense
            if len(plain) == len(self.layout.params):  # the usual case: the whole buffer
                self.add(None, clipped)
            else:
                offset = 0
                for p in plain:
                    k = p.numel()
                    self.add(p, clipped[offset : offset + k])
                    offset += k
        for p in factored:
            self.add(p, per_ex[p].weighted_sum(factors * scale).to(self.layout.dtype))

    def add(self, p: nn.Parameter | None, clipped: torch.Tensor) -> None:
        """Add a clipped contribution: of parameter `p`, or of every trainable parameter
        (p None, `clipped` laid out as the flat layout)."""
        if p is None and self._sum is None:
            # a fresh tensor (the clipping matmul's result), in the flat layout's dtype
            self._sum = clipped.to(self.layout.dtype)
            return
        if self._sum is None:
            self._sum = self.layout.zeros()
        if p is None:
            self._sum += clipped.to(self._sum.device)
        else:
            self._sum[self.layout.span(p)] += clipped.reshape(-1).to(self._sum.device)

    def take(self) -> torch.Tensor:
        """The finished sum (zeros for a logical batch without examples here); starts anew."""
        summed = self._sum if self._sum is not None else self.layout.zeros()
        self._sum = None
        return summed

    def clear(self) -> None:
        self._sum = None


class DocumentSums:
    """privacy_unit="document": the unclipped gradient of each document of the logical batch.

    A long document is several rows (its windows), possibly in several physical batches, and
    it is one contribution: its rows are summed first, then the sum is clipped once, at the
    end of the logical batch (`clip_into`). Clipping each row alone would bound a window, not
    the document: a document of k windows could then move the sum by k R.

    Dense rows only (bias mode): one (documents, elements) float32 buffer, small for biases.
    """

    def __init__(self, layout: FlatLayout) -> None:
        self.layout = layout
        self._docs: torch.Tensor | None = None  # (documents, layout.numel)

    @property
    def started(self) -> bool:
        return self._docs is not None

    def add(self, batch: PhysicalBatch, groups: torch.Tensor, documents: int, scale: float) -> None:
        """Add each row of `batch` (times `scale`, its loss scale) to its document's sum.

        groups: (rows,) the document of each row, an index in [0, documents) within the
        logical batch; documents: how many documents the logical batch holds.
        """
        if batch.factored:
            raise ValueError("privacy_unit='document' needs dense per-example rows (mode='bias')")
        if groups.shape != (batch.rows,):
            raise ValueError(
                f"{batch.rows} per-example rows but {tuple(groups.shape)} document ids; give "
                "one document id per row of the batch"
            )
        if batch.rows and not 0 <= int(groups.min()) <= int(groups.max()) < documents:
            raise ValueError(f"document ids must be in [0, {documents}), got {groups.tolist()}")
        if batch.dense is None:
            return
        rows = batch.dense
        if len(batch.plain) != len(self.layout.params):  # place the columns in the layout
            full = rows.new_zeros(batch.rows, self.layout.numel)
            offset = 0
            for p in batch.plain:
                k = p.numel()
                full[:, self.layout.span(p)] = rows[:, offset : offset + k]
                offset += k
            rows = full
        if self._docs is None:
            self._docs = rows.new_zeros(documents, self.layout.numel)
        elif self._docs.shape[0] != documents:
            raise ValueError(
                f"the logical batch holds {self._docs.shape[0]} documents, this physical batch "
                f"says {documents}"
            )
        self._docs.index_add_(0, groups.to(rows.device), rows, alpha=scale)

    def clip_into(
        self,
        target: ClippedSum,
        clip_fn: Callable[[torch.Tensor, float], torch.Tensor],
        max_grad_norm: float,
    ) -> None:
        """Clip each document's summed gradient and add it to `target`; starts anew."""
        docs, self._docs = self._docs, None
        if docs is None:
            return
        factors = clip_fn(docs.norm(dim=1), max_grad_norm)
        target.add(None, factors @ docs)

    def clear(self) -> None:
        self._docs = None

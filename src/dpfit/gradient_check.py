"""The per-step gradient check: per-example gradients must add up to autograd's `.grad`.

A parameter used where its sampler cannot see it (a functional call reusing a bias), or a batch
axis other than the declared one, gives per-example rows that do not sum to the parameter's
gradient; clipping such rows would not bound each example's contribution. The check runs on
every physical batch (`PrivacyEngine(check_gradients=True)`, the default): two reductions over
the per-example matrix and one host transfer.

The error is measured against the size of what was added, not of the result: per-example
gradients that nearly cancel (a balanced binary task, a head that already fits) leave a small
sum, and the two summation orders then differ by rounding far above a tolerance set by that
sum. Rounding is bounded by the norm of the sum of absolute per-example values (for factored
weights, by the sum of per-example norms); a capture bug misses whole terms, which is that large.
"""

from __future__ import annotations

import torch
from torch import nn

from dpfit.clipped_sum import PhysicalBatch
from dpfit.errors import GradientMismatchError
from dpfit.flat import FlatLayout


class AutogradCheck:
    """Compares, per parameter, the sum over examples with autograd's gradient."""

    def __init__(
        self, params: list[nn.Parameter], layout: FlatLayout, names: dict[nn.Parameter, str]
    ) -> None:
        self.params = params
        self.layout = layout
        self.names = names
        self._all_positions = tuple(range(len(params)))
        self._tolerances: dict[tuple[torch.dtype, ...], list[float]] = {}

    def __call__(self, batch: PhysicalBatch, compute_dtype: torch.dtype | None = None) -> None:
        """compute_dtype: the autocast dtype the forward and backward ran in, if lower than the
        parameters' (bf16 autocast over float32 masters): autograd's `.grad` then carries that
        dtype's rounding, and the tolerance follows it."""
        names, per_ex, plain, factored = self.names, batch.per_example, batch.plain, batch.factored
        grads = [p.grad for p in self.params]
        # every parameter seen per example (the usual case) needs no lookup by parameter
        everything = len(plain) + len(factored) == len(self.params)
        if not everything or any(g is None for g in grads):
            for p, grad in zip(self.params, grads, strict=True):
                if (per_ex.get(p) is None) != (grad is None):
                    raise GradientMismatchError(
                        f"parameter '{names.get(p)}' got a gradient dpfit did not see per "
                        "example (used outside its module's forward, e.g. through a functional "
                        "call)"
                        if per_ex.get(p) is None
                        else f"parameter '{names.get(p)}' has per-example gradients but no "
                        ".grad; do not zero gradients between backward and engine.step"
                    )
        if not plain and not factored:
            return
        # compared in the flat layout's dtype (float32, or float64 for a float64 model);
        # bf16/fp16 gradients carry rounding of a few ulps
        sq_parts, checked = [], []  # rows: squared error norm, squared size of what was added
        if plain:
            assert batch.dense is not None
            ref = torch.cat([p.grad.reshape(-1) for p in plain]).to(batch.dense.dtype)
            if len(plain) == len(self.params):
                positions = self._all_positions
            else:
                positions = tuple(self.layout.position(p) for p in plain)
            ids = self.layout.segment_ids(positions, ref.device)
            dense = batch.dense.to(ref.device)
            both = torch.stack([dense.sum(0) - ref, dense.abs().sum(0)]).square_()
            sq_parts.append(ref.new_zeros(2, len(plain)).index_add_(1, ids, both))
            checked += plain
        if factored:
            dev = sq_parts[0].device if sq_parts else factored[0].grad.device
            totals = [per_ex[p].sum(0).float() for p in factored]
            refs = [p.grad.float() for p in factored]
            errs = torch.stack(
                [e.to(dev) for e in torch._foreach_norm(torch._foreach_sub(totals, refs))]
            )
            norms = torch.stack([batch.factored_sq_norms(p).sqrt().sum().to(dev) for p in factored])
            sq_parts.append(torch.stack([errs, norms]).pow(2))
            checked += factored
        sq = sq_parts[0] if len(sq_parts) == 1 else torch.cat(sq_parts, 1)
        # compared on the host: one transfer, then a loop over parameters, instead of a few
        # more tensor ops (each costs more than the loop at these sizes)
        sq_errs, sq_sizes = sq.tolist()
        dtypes = tuple([p.grad.dtype for p in checked])
        key = (*dtypes, compute_dtype)
        rel_tols = self._tolerances.get(key)
        if rel_tols is None:
            low = torch.finfo(compute_dtype).eps if compute_dtype is not None else 0.0
            rel_tols = [max(1e-3, 8 * torch.finfo(d).eps, 8 * low) for d in dtypes]
            self._tolerances[key] = rel_tols
        for p, sq_err, sq_size, tol in zip(checked, sq_errs, sq_sizes, rel_tols, strict=True):
            err, size = sq_err**0.5, sq_size**0.5
            if err > tol * size + 1e-6:
                raise GradientMismatchError(
                    f"per-example gradients of '{names.get(p)}' do not add up to "
                    f"autograd's (error {err / (size + 1e-12):.2e} of the per-example total). The "
                    "parameter is used in a way its sampler does not capture, or the batch "
                    "axis is not where declared (batch_first / batch_dims)."
                )

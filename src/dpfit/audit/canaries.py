"""Canaries: which are included, the white-box gradient canaries, and per-canary scores.

A white-box canary is a training example whose per-example gradient is a fixed unit direction
u_j in one audited module's bias space, times `scale` (> 1, so the engine's clipping brings it
to exactly R u_j). It is built without touching the engine: for a canary row, a forward
pre-hook zeroes the audited module's input (so its output is its bias, the weights and every
layer upstream get no gradient from that row) and the row's loss is scale * <u_j, output at
position 0>, with no task loss. Its gradient therefore reaches the engine through the same
hooks, per-example norms, clipping, Poisson sampling and noise as any real example, which is
what lets faults anywhere on that path show.

An excluded canary keeps its slot in the data set as an inert row (loss weight 0, so its
gradient is exactly 0): the data set size, hence the sampling rate q = B / N the accountant
uses, does not depend on which canaries are in. Adding an inert row changes no output
distribution, so this is the add/remove neighbouring relation at a fixed q.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from dpfit.audit.bounds import AuditError
from dpfit.sampling import secure_seed

SCORES = ("llr", "sum", "max")


def draw_inclusion(m: int, seed: int | None = None) -> torch.Tensor:
    """Each of m canaries in with probability 1/2, independently (secret; OS-seeded by default)."""
    if m < 2:
        raise AuditError(f"an audit needs at least 2 canaries, got {m}")
    gen = torch.Generator().manual_seed(secure_seed() if seed is None else seed)
    return torch.rand(m, generator=gen) < 0.5


class GradientCanaries:
    """m gradient canaries spread over the audited modules' biases, in proportion to their size.

    Each direction is a random unit vector in its module's bias space (public randomness);
    the directions in one module are orthonormal when there are no more of them than the bias
    has entries, so canaries add no noise to each other's scores.
    """

    def __init__(
        self,
        model: nn.Module,
        targets: Sequence[str],
        m: int,
        scale: float = 10.0,
        seed: int = 0,
    ) -> None:
        if not targets:
            raise AuditError("white-box canaries need at least one audited module")
        if scale <= 1:
            raise AuditError(f"canary scale must be > 1 (above the clip norm), got {scale}")
        self.targets = list(targets)
        self.modules: list[nn.Module] = []
        for name in self.targets:
            try:
                mod = model.get_submodule(name)
            except AttributeError:
                raise AuditError(f"no module {name!r} in the model to place canaries in") from None
            bias = getattr(mod, "bias", None)
            if not isinstance(bias, nn.Parameter) or not bias.requires_grad:
                raise AuditError(
                    f"module {name!r} has no trainable bias; audit a module whose bias trains"
                )
            self.modules.append(mod)
        self.m = m
        self.scale = float(scale)
        # canaries per module in proportion to its bias size (orthonormal as long as possible)
        sizes = torch.tensor([float(mod.bias.numel()) for mod in self.modules])
        counts = torch.floor(m * sizes / sizes.sum()).long()
        counts[: m - int(counts.sum())] += 1
        self.target_of = torch.repeat_interleave(torch.arange(len(self.modules)), counts)
        gen = torch.Generator().manual_seed(seed)
        self.directions = torch.zeros(m, max(mod.bias.numel() for mod in self.modules))
        for k, mod in enumerate(self.modules):
            rows = (self.target_of == k).nonzero().flatten()
            d = mod.bias.numel()
            g = torch.randn(d, len(rows), generator=gen, dtype=torch.float64)
            if len(rows) <= d:  # orthonormal: canaries do not interfere with each other
                u = torch.linalg.qr(g).Q.T
            else:
                u = (g / g.norm(dim=0, keepdim=True)).T
            self.directions[rows, :d] = u.float()

    def bias(self, k: int) -> nn.Parameter:
        return self.modules[k].bias

    @contextmanager
    def active(self, canary_ids: torch.Tensor) -> Iterator[dict]:
        """Hooks for one forward pass; yields a dict the forward fills with module outputs.

        canary_ids: (n,) canary index per row, -1 for a real example.
        """
        outputs: dict[int, torch.Tensor] = {}
        handles = []
        canary_ids = canary_ids.cpu()
        for k, mod in enumerate(self.modules):
            mine = (canary_ids >= 0) & (self.target_of[canary_ids.clamp(min=0)] == k)

            def pre(module, args, mine=mine):
                x = args[0]
                keep = (~mine).to(device=x.device, dtype=x.dtype).view(-1, *([1] * (x.dim() - 1)))
                return (x * keep, *args[1:])

            def post(module, args, out, k=k):
                outputs[k] = out

            handles.append(mod.register_forward_pre_hook(pre))
            handles.append(mod.register_forward_hook(post))
        try:
            yield outputs
        finally:
            for h in handles:
                h.remove()

    def loss_terms(
        self, outputs: dict[int, torch.Tensor], canary_ids: torch.Tensor, live: torch.Tensor
    ) -> torch.Tensor:
        """Per-row canary loss: scale * <u_j, output at the first position>, 0 elsewhere.

        live: (n,) 1.0 where the row is an included canary, 0.0 elsewhere (excluded canaries
        stay inert).
        """
        n = canary_ids.shape[0]
        canary_ids = canary_ids.cpu()
        total = None
        for k, mod in enumerate(self.modules):
            out = outputs[k]
            d = mod.bias.numel()
            if out.shape[0] != n or out.shape[-1] != d:
                raise AuditError(
                    f"module {self.targets[k]!r} output {tuple(out.shape)} is not (batch, ..., "
                    f"{d}); place white-box canaries in a Linear or LayerNorm"
                )
            first = out.reshape(n, -1, d)[:, 0, :]
            ids = canary_ids.clamp(min=0)
            mine = ((canary_ids >= 0) & (self.target_of[ids] == k)).to(first)
            u = self.directions[ids, :d].to(first)
            term = self.scale * (first * u).sum(1) * mine * live.to(first)
            total = term if total is None else total + term
        assert total is not None
        return total

    def observe(self, grads: dict[int, torch.Tensor]) -> torch.Tensor:
        """<g, u_j> for every canary j, given each audited bias's released gradient g."""
        x = torch.empty(self.m)
        for k, mod in enumerate(self.modules):
            rows = (self.target_of == k).nonzero().flatten()
            d = mod.bias.numel()
            x[rows] = self.directions[rows, :d] @ grads[k].detach().float().reshape(-1).cpu()
        return x


def scores_from_observations(x: torch.Tensor, kind: str, q: float, sigma: float) -> torch.Tensor:
    """Per-canary score from observations x (steps, m), each in clip-norm units.

    llr: the log-likelihood ratio of "in" (x_t ~ q N(1, s^2) + (1-q) N(0, s^2)) against "out"
    (x_t ~ N(0, s^2)) at the claimed sigma s and rate q, summed over steps: the Neyman-Pearson
    test for one canary. sum: sum_t x_t. max: max_t x_t (a canary seen in one step).
    """
    if kind not in SCORES:
        raise AuditError(f"score must be one of {SCORES}, got {kind!r}")
    if kind == "sum":
        return x.sum(0)
    if kind == "max":
        return x.max(0).values
    if sigma <= 0:
        return x.sum(0)  # no noise claimed: any monotone score is optimal
    a = (2 * x.double() - 1) / (2 * sigma**2)
    if q >= 1:
        return a.sum(0)
    return torch.logaddexp(torch.full_like(a, math.log1p(-q)), math.log(q) + a).sum(0)

"""Are the per-example rows examples? The microbatch-of-one oracle, at run time, for one example.

A per-example row count equal to the batch size does not prove that rows are examples: a
sequence-first model whose sequence length equals the batch size passes any row-count check,
and its "per-example" rows are then positions, each mixing every example (clipping would bound
positions, not examples). So on the first step (and again after a phase switch) the engine
takes one example of the physical batch, computes its gradient alone, and compares it with
that example's row. Shapes play no part in the verdict.

How, without knowing the user's loss: the model's call (arguments) and the gradient reaching
each of its outputs (the cotangent the loss sent back) are captured during the user's own
forward and backward. Then, in eval mode (dropout masks of one example alone could never match
those of a batch) and under a forked RNG (the run's random streams are left untouched):

* the batch again, backward with the captured cotangents: per-example rows from the hooks;
* example i alone (every input sliced on its batch axis, axis 0 as the loader collates),
  backward with the cotangent of example i's output: autograd's gradient, the oracle.

Row i must equal the oracle. Nothing computed here is released or kept: gradients, the hooks'
store and the modules' train/eval flags are restored, so the privacy mechanism is unchanged.
The cost is one extra forward and backward of the batch and of one example, once per phase.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from dpfit.errors import BatchAxisError

log = logging.getLogger(__name__)

Path = tuple[Any, ...]


def _leaves(x: Any, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    """(path, tensor) for every tensor in nested tuples, lists and mappings (model outputs)."""
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, Mapping):
        for k, v in x.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(x, (tuple, list)):
        for k, v in enumerate(x):
            yield from _leaves(v, (*path, k))


def _map(x: Any, fn) -> Any:
    """The same nested tuples, lists and mappings with `fn` applied to every tensor."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, Mapping):
        items = {k: _map(v, fn) for k, v in x.items()}
        try:
            return type(x)(items)
        except TypeError:
            return items
    if isinstance(x, tuple):
        return tuple(_map(v, fn) for v in x)
    if isinstance(x, list):
        return [_map(v, fn) for v in x]
    return x


def _example_of(x: Any, n: int, i: int) -> Any:
    """The same structure with every batched tensor cut to example i (a length-1 batch).

    A tensor's batch axis is axis 0 when its size is n (how collate stacks examples), else its
    first axis of size n; a tensor with no axis of size n (position ids (1, L), a mask shared
    by the batch) is passed whole."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        axes = [a for a in range(t.dim()) if t.shape[a] == n]
        if not axes:
            return t
        return t.narrow(0 if t.shape[0] == n else axes[0], i, 1)

    return _map(x, cut)


def _output_axis(batch_shape: torch.Size, alone_shape: torch.Size, n: int) -> int | None:
    """The axis that holds examples in an output: n in the batch's, 1 in the example's."""
    if len(batch_shape) != len(alone_shape):
        return None
    axes = [a for a, (b, s) in enumerate(zip(batch_shape, alone_shape, strict=True)) if b != s]
    if len(axes) == 1 and batch_shape[axes[0]] == n and alone_shape[axes[0]] == 1:
        return axes[0]
    return None


def tolerance(dtype: torch.dtype) -> float:
    """Relative error allowed between row i and the oracle: rounding of batched vs single
    arithmetic, far below the O(1) error of rows that are not examples."""
    return min(0.1, max(1e-4, 1000 * torch.finfo(dtype).eps))


class BatchAxisProbe:
    """Captures one forward call and its output cotangents, then checks one example's row.

    Armed at construction and by `arm()` (a phase switch); disarmed, with its hooks removed,
    once a check has passed.
    """

    def __init__(self, model: nn.Module, names: Mapping[nn.Parameter, str]) -> None:
        self.model = model
        self.names = names
        self.pending = True
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._running = False
        self._call: tuple[tuple, dict] | None = None
        self._shapes: dict[Path, torch.Size] = {}
        self._cotangents: dict[Path, torch.Tensor] = {}

    def attach(self) -> None:
        if self.pending and not self._handles:
            self._handles = [
                self.model.register_forward_pre_hook(self._on_call, with_kwargs=True),
                self.model.register_forward_hook(self._on_output, with_kwargs=True),
            ]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._forget()

    def arm(self) -> None:
        self.pending = True
        self.attach()

    def _forget(self) -> None:
        self._call = None
        self._shapes = {}
        self._cotangents = {}

    # ------------------------------------------------------------------ capture
    def _on_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._running or not torch.is_grad_enabled():
            return
        self._forget()
        self._call = (args, dict(kwargs))

    def _on_output(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if self._running or not torch.is_grad_enabled() or self._call is None:
            return
        for path, t in _leaves(output):
            if t.requires_grad:
                self._shapes[path] = t.shape
                t.register_hook(self._cotangent_hook(path))

    def _cotangent_hook(self, path: Path):
        def hook(g: torch.Tensor) -> None:
            prev = self._cotangents.get(path)
            self._cotangents[path] = g.detach() if prev is None else prev + g.detach()

        return hook

    # ------------------------------------------------------------------ check
    def check(self, per_example: Mapping[nn.Parameter, Any], n: int, hooks: Any) -> None:
        """Raise BatchAxisError unless example i's row equals its gradient computed alone.

        `per_example`: this physical batch's rows (which parameters have plain rows); `n`: the
        examples in the batch; `hooks`: the engine's PerExampleHooks (their store is used for
        the batch rerun and left empty, as `collect()` leaves it)."""
        if not self.pending or n < 2:
            return  # one example: its row is the whole gradient, whatever the axis
        plain = [p for p, g in per_example.items() if isinstance(g, torch.Tensor)]
        if self._call is None or not self._cotangents or not plain:
            log.debug("batch-axis probe: nothing captured this step; checking a later one")
            self._forget()
            return
        i = n // 2
        rows, alone = self._rerun(n, i, hooks)
        self._forget()
        if rows is None:
            return
        err = size = 0.0
        for p in plain:
            r, a = rows.get(p), alone.get(p)
            if not isinstance(r, torch.Tensor) or a is None:
                continue
            if r.shape[0] != n:
                self._fail(f"the rerun gave {r.shape[0]} rows for {n} examples")
            diff = r[i].double().reshape(-1) - a.double().reshape(-1)
            err += float(diff.pow(2).sum())
            size += float(a.double().pow(2).sum())
        tol = tolerance(plain[0].dtype)
        rel = math.sqrt(err) / max(math.sqrt(size), 1e-30)
        if err > 0 and rel > tol:
            self._fail(
                f"example {i}'s row differs from its gradient computed alone by {rel:.2g} "
                f"(relative, tolerance {tol:.0e})"
            )
        log.debug("batch-axis probe passed: row %d of %d matches its oracle (%.2g)", i, n, rel)
        self.pending = False
        self.detach()

    def _rerun(self, n: int, i: int, hooks: Any):
        """(rows of the batch, example i's gradient alone), both in eval mode, or (None, None)
        when no output of the model has an example axis to cut its cotangent on."""
        assert self._call is not None
        # inputs computed upstream carry a graph the user's backward already freed: the
        # parameters' gradients need none of it
        args, kwargs = _map(self._call, lambda t: t.detach())
        cotangents = self._cotangents
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        saved_grads = {p: p.grad for p in trainable}
        modes = {m: m.training for m in self.model.modules()}
        devices = sorted(
            {t.device.index for _, t in _leaves((args, kwargs)) if t.device.type == "cuda"}
        )
        self._running = True
        try:
            with torch.random.fork_rng(devices=devices):
                self.model.eval()
                for p in trainable:
                    p.grad = None
                a_args, a_kwargs = _example_of((args, kwargs), n, i)
                out = dict(_leaves(self.model(*a_args, **a_kwargs)))
                pairs: dict[Path, tuple[torch.Tensor, int]] = {}
                for path in cotangents:
                    t = out.get(path)
                    if t is None or not t.requires_grad:
                        continue
                    axis = _output_axis(self._shapes[path], t.shape, n)
                    if axis is not None:
                        pairs[path] = (t, axis)
                if not pairs:
                    log.warning(
                        "batch-axis probe: no output of the model has an axis of examples "
                        "(outputs %s); the per-example rows are checked by count only",
                        {k: tuple(v) for k, v in self._shapes.items()},
                    )
                    self.pending = False
                    return None, None
                torch.autograd.backward(
                    [t for t, _ in pairs.values()],
                    [cotangents[k].narrow(ax, i, 1).to(t.dtype) for k, (t, ax) in pairs.items()],
                )
                alone = {
                    p: (torch.zeros_like(p) if p.grad is None else p.grad.detach().clone())
                    for p in trainable
                }
                hooks.per_example.clear()
                for p in trainable:
                    p.grad = None
                out = dict(_leaves(self.model(*args, **kwargs)))
                torch.autograd.backward(
                    [out[k] for k in pairs], [cotangents[k].to(out[k].dtype) for k in pairs]
                )
                rows = hooks.collect()
        finally:
            self._running = False
            hooks.per_example.clear()
            for m, training in modes.items():
                m.training = training
            for p, g in saved_grads.items():
                p.grad = g
        return rows, alone

    def _fail(self, what: str) -> None:
        # stays armed: a caller that catches this and steps again is stopped again
        raise BatchAxisError(
            f"the per-example gradients are not per example: {what}. The model sees the "
            "batch on another axis than the engine assumes (batch_first=True by default), so "
            "clipping would bound positions, not examples; nothing was released. For "
            "sequence-first models (e.g. nn.TransformerEncoderLayer(batch_first=False), RNNs) "
            "build the engine with batch_first=False, or give batch_dims={layer_name: axis} "
            "for single layers."
        )

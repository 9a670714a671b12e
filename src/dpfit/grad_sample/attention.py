"""nn.MultiheadAttention: in-projection and out-projection biases.

Both biases are added inside ``F.multi_head_attention_forward``, so there is no submodule
output to hook. After the layer's forward we walk its (small) autograd graph back from the
output to the inputs, find the nodes that add ``in_proj_bias`` (whole, or a slice made by
``split``/``chunk``) and ``out_proj.bias``, and put a pre-hook on each: that hook receives the
gradient of the projection output, which is all a bias needs. Nothing is cached. Inside that
function tensors are sequence-first, (T, B, n) or flattened (T*B, n), whatever
``batch_first`` says.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dpfit.grad_sample.registry import register_capture

_MAX_NODES = 20_000
_BIAS_ADDERS = ("AddBackward0", "AddmmBackward0")  # the ops F.linear uses to add a bias


def _accumulate_var(node: Any) -> torch.Tensor | None:
    return getattr(node, "variable", None) if type(node).__name__ == "AccumulateGrad" else None


def _bias_slice(child: Any, input_nr: int, bias: torch.Tensor) -> tuple[int, int] | None:
    """(offset, length) of `bias` that flows out of `child`'s output `input_nr`, if any."""
    if _accumulate_var(child) is bias:
        return 0, bias.numel()
    name = type(child).__name__
    if name not in ("SplitBackward0", "SplitWithSizesBackward0", "UnsafeSplitBackward0"):
        return None
    if not any(_accumulate_var(c) is bias for c, _ in child.next_functions if c is not None):
        return None
    if name == "SplitWithSizesBackward0":
        sizes = list(child._saved_split_sizes)
    else:
        size = int(child._saved_split_size)
        sizes = [size] * ((bias.numel() + size - 1) // size)
    return sum(sizes[:input_nr]), sizes[input_nr]


@register_capture(nn.MultiheadAttention, params=("in_proj_bias", "out_proj.bias"))
def mha_capture(layer: nn.Module, inputs: tuple, output: Any, emit: Callable) -> None:
    query = inputs[0]
    if query.dim() != 3:
        raise ValueError("nn.MultiheadAttention got an unbatched query; dpfit needs a batch axis")
    if layer.bias_k is not None and layer.bias_k.requires_grad:
        raise ValueError(
            "nn.MultiheadAttention(add_bias_kv=True): bias_k / bias_v are not supported; freeze them"
        )
    out = output[0]
    if out.grad_fn is None:
        return
    bsz = query.shape[0] if layer.batch_first else query.shape[1]
    targets = {
        name: p
        for name, p in (
            ("in_proj_bias", layer.in_proj_bias),
            ("out_proj.bias", layer.out_proj.bias),
        )
        if p is not None and p.requires_grad
    }
    stop = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    seen: set = set()
    stack = [out.grad_fn]
    while stack and len(seen) < _MAX_NODES:
        node = stack.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        adds_bias = type(node).__name__ in _BIAS_ADDERS
        for child, input_nr in node.next_functions:
            if child is None:
                continue
            for name, bias in targets.items() if adds_bias else ():
                sl = _bias_slice(child, input_nr, bias)
                if sl is not None:
                    node.register_prehook(_make_hook(emit, name, sl, bias.numel(), bsz))
            if _accumulate_var(child) is None:
                stack.append(child)


def _make_hook(emit: Callable, name: str, sl: tuple[int, int], total: int, bsz: int) -> Callable:
    offset, n = sl

    def hook(grad_outputs: tuple) -> None:
        g = grad_outputs[0]
        per = g.reshape(-1, bsz, n).sum(0)  # rows are (position, example), position-major
        if n != total:
            full = per.new_zeros(bsz, total)
            full[:, offset : offset + n] = per
            per = full
        emit(name, per)

    return hook

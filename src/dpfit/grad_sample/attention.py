"""nn.MultiheadAttention: in-projection and out-projection biases.

Both biases are added inside ``F.multi_head_attention_forward``, so there is no submodule
output to hook. After the layer's forward we walk its (small) autograd graph back from the
output to the inputs, find the nodes that add ``in_proj_bias`` (whole, or a slice made by
``split``/``chunk``) and ``out_proj.bias``, and put a pre-hook on each: that hook receives the
gradient of the projection output, which is all a bias needs. No tensor is cached; the route
to each such node is kept per layer, so later forwards follow it instead of walking again. Inside that
function tensors are sequence-first, (T, B, n) or flattened (T*B, n), whatever
``batch_first`` says.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dpfit.grad_sample.registry import register_capture, sum_positions

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


@dataclass(frozen=True)
class _Adder:
    """A node that adds (a slice of) one bias, as a route from the output's grad_fn."""

    route: tuple[int, ...]  # indices into next_functions, from out.grad_fn to the node
    child: int  # the bias's index among the node's next_functions
    name: str
    slice: tuple[int, int]


# per layer: the adders found by the last walks of its graph, keyed by the trainable bias
# names, most recent first (a layer's graph has a few variants: batch of one or not, query is
# key or not)
_ROUTES: weakref.WeakKeyDictionary[nn.Module, list[tuple[tuple[str, ...], tuple[_Adder, ...]]]] = (
    weakref.WeakKeyDictionary()
)
_VARIANTS = 4


def _walk(root: Any, targets: dict[str, torch.Tensor], stop: set) -> list[tuple[Any, _Adder]]:
    """Every node between the output and the inputs that adds a slice of a target bias."""
    found = []
    seen: set = set()
    stack: list[tuple[Any, tuple[int, ...]]] = [(root, ())]
    while stack and len(seen) < _MAX_NODES:
        node, route = stack.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        adds_bias = type(node).__name__ in _BIAS_ADDERS
        for i, (child, input_nr) in enumerate(node.next_functions):
            if child is None:
                continue
            for name, bias in targets.items() if adds_bias else ():
                sl = _bias_slice(child, input_nr, bias)
                if sl is not None:
                    found.append((node, _Adder(route, i, name, sl)))
            if _accumulate_var(child) is None:
                stack.append((child, (*route, i)))
    return found


def _covers(adders: tuple[_Adder, ...], targets: dict[str, torch.Tensor]) -> bool:
    """Each bias is added exactly once, element for element (the slices tile it)."""
    for name, bias in targets.items():
        spans = sorted(a.slice for a in adders if a.name == name)
        end = 0
        for offset, n in spans:
            if offset != end:
                return False
            end += n
        if end != bias.numel():
            return False
    return True


def _follow(
    root: Any, adders: tuple[_Adder, ...], targets: dict[str, torch.Tensor]
) -> list[tuple[Any, _Adder]] | None:
    """The same adders reached along their recorded routes, each verified to add the same
    slice of the same bias; None when any route leads elsewhere (the graph changed)."""
    found = []
    try:  # a route index past a node's inputs is a changed graph (IndexError), as is None
        for a in adders:
            node = root
            for i in a.route:
                node = node.next_functions[i][0]
                if node is None:
                    return None
            if type(node).__name__ not in _BIAS_ADDERS:
                return None
            child, input_nr = node.next_functions[a.child]
            if child is None or _bias_slice(child, input_nr, targets[a.name]) != a.slice:
                return None
            found.append((node, a))
    except IndexError:
        return None
    return found


@register_capture(nn.MultiheadAttention, params=("in_proj_bias", "out_proj.bias"))
def mha_capture(layer: nn.Module, inputs: tuple, output: Any, emit: Callable) -> None:
    """Finding the bias adders by a walk over the layer's graph costs a Python loop over
    every node on every forward; the walk's routes are kept per layer and later forwards only
    follow them. That is exact: a route is taken only when the node at its end is verified to
    add the recorded slice of that bias, the recorded slices tile each bias, and
    F.multi_head_attention_forward adds each bias element once per call. Any mismatch (query
    is key or not, another bias frozen) falls back to the walk."""
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
    names = tuple(targets)
    variants = _ROUTES.get(layer)  # (WeakKeyDictionary.setdefault costs more on every call)
    if variants is None:
        variants = _ROUTES[layer] = []
    found = None
    for i, (key, adders) in enumerate(variants):
        if key == names:
            found = _follow(out.grad_fn, adders, targets)
            if found is not None:
                variants.insert(0, variants.pop(i))
                break
    if found is None:
        stop = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        found = _walk(out.grad_fn, targets, stop)
        adders = tuple(a for _, a in found)
        if _covers(adders, targets):
            variants.insert(0, (names, adders))
            del variants[_VARIANTS:]
    for node, a in found:
        node.register_prehook(_make_hook(emit, a.name, a.slice, targets[a.name].numel(), bsz))


def _make_hook(emit: Callable, name: str, sl: tuple[int, int], total: int, bsz: int) -> Callable:
    offset, n = sl

    def hook(grad_outputs: tuple) -> None:
        g = grad_outputs[0]
        per = sum_positions(g.reshape(-1, bsz, n), 1)  # rows: (position, example), position-major
        if n != total:
            full = per.new_zeros(bsz, total)
            full[:, offset : offset + n] = per
            per = full
        emit(name, per)

    return hook

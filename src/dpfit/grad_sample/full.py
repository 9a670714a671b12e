"""Full DP fine-tuning: per-example weight-gradient norms without per-example gradients.

Why: in full mode every weight trains, and materialising a [B, p, d] gradient per linear layer
is what makes DP full fine-tuning slow and memory hungry. For a layer computing
``y_t = W a_t`` over positions t, the per-example gradient is ``G_i = sum_t g_it a_it^T``:
a product of two small factors. We keep the factors (book-keeping, Bu et al. 2023) and

* take the norm by the *ghost norm* ``||G_i||_F^2 = <A_i A_i^T, H_i H_i^T>`` (Gram matrices of
  size T x T) when that is cheaper than materialising G_i, i.e. when ``2 T^2 < p d`` (the
  per-layer choice of mixed ghost clipping, Bu et al. 2022), and then
* take the clipped weighted sum ``sum_i c_i G_i = (c * H)^T A`` as one matrix product, so no
  second backward pass is needed.

Otherwise (``2 T^2 >= p d``) the sampler materialises G_i [B, p, d] at once, in the backward
hook, and returns that plain tensor (:func:`settle`): its norm and its clipped sum (one [B] x
[B, p d] product) then come from the one per-example product, and the factors are freed. That
is cheaper in time (one ``T p d`` product per example instead of two: the norm's and the
book-keeping sum's) and in memory: ``p d <= 2 T^2`` implies ``p d <= T (p + d) / sqrt(2)``, so
B p d numbers take less room than the kept factors B T (p + d) (for a convolution the factor
A is the unfolded input, kernel-size times larger than the input itself).

One representation, :class:`OuterGrad`, covers nn.Linear, transformers' Conv1D, convolutions
(through their unfolded patches) and nn.Embedding (whose input factor is a one-hot of the token
ids, never materialised). It is a *sum of terms*, so a module called twice in one forward, or a
weight tied between an embedding and an output layer, is still exact: the cross terms of the
Gram matrices are included.

Samplers here are registered in a second registry that the engine consults in full mode only;
layers without an entry (norm weights, where the explicit gradient is only [B, d]) fall back to
the explicit weight samplers of the ordinary registry.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpfit.errors import UnsupportedLayerError
from dpfit.grad_sample.linear import HF_CONV1D
from dpfit.grad_sample.registry import (
    WeightSampler,
    _qualname,
    move_batch_first,
    register_weight_sampler,
)

__all__ = [
    "OneHot",
    "OuterGrad",
    "batch_size_of",
    "is_factored",
    "norm_sampler_for",
    "register_norm_sampler",
    "settle",
]


# --------------------------------------------------------------------------- factors
@dataclass(frozen=True)
class OneHot:
    """The one-hot rows of token ids, [B, T] -> implicitly [B, T, size]; never materialised."""

    ids: torch.Tensor  # [B, T], long
    size: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.ids.shape[0], self.ids.shape[1], self.size)


Factor = torch.Tensor | OneHot


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything narrower (bf16, fp16) is accumulated in float32, so
    a clip factor is computed from, and applied to, the same float32 gradient."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _up(x: Factor, dtype: torch.dtype) -> Factor:
    return x if isinstance(x, OneHot) else x.to(dtype)


def _gram(x: Factor, y: Factor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Tx, Ty] inner products between the rows of x and of y, per example."""
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return torch.bmm(x, y.transpose(1, 2))
    if isinstance(x, OneHot) and isinstance(y, OneHot):
        return (x.ids[:, :, None] == y.ids[:, None, :]).to(dtype)
    if isinstance(x, OneHot):  # y dense [B, Ty, V]: <e_{ids[t]}, y_s> = y[b, s, ids[b, t]]
        b, ty = y.shape[0], y.shape[1]
        idx = x.ids[:, None, :].expand(b, ty, x.ids.shape[1])
        return y.gather(2, idx).transpose(1, 2)
    return _gram(y, x, dtype).transpose(1, 2)


# --------------------------------------------------------------------------- the gradient
class OuterGrad:
    """Per-example gradients ``G_i = sum_k X_k[i]^T Y_k[i]`` kept in factored form.

    Each term holds X_k [B, T_k, rows] (dense, or a :class:`OneHot`) and Y_k [B, T_k, cols];
    the parameter is the [rows, cols] matrix viewed as ``param_shape``. The engine asks for
    ``sq_norms()`` (float32 [B]) and ``weighted_sum(c)``; ``materialize()`` exists for tests
    and for the explicit branch. All three compute in float32 at least (float64 for float64
    factors), whatever the model's dtype: a bf16 norm is off by ~0.4%, enough to let a
    clipped contribution exceed R.
    """

    __slots__ = ("terms", "param_shape", "rows", "cols")

    def __init__(
        self,
        terms: tuple[tuple[Factor, torch.Tensor], ...],
        param_shape: torch.Size | tuple[int, ...],
    ) -> None:
        x0, y0 = terms[0]
        self.terms = terms
        self.param_shape = torch.Size(param_shape)
        self.rows = x0.shape[2]
        self.cols = y0.shape[2]
        if self.rows * self.cols != self.param_shape.numel():
            raise ValueError(f"factors {self.rows}x{self.cols} do not make {self.param_shape}")

    # -- shape-like API the engine relies on
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.batch_size, *self.param_shape))

    @property
    def batch_size(self) -> int:
        return self.terms[0][1].shape[0]

    @property
    def positions(self) -> int:
        return sum(y.shape[1] for _, y in self.terms)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine sees: the accumulation dtype, not the model's."""
        return accumulation_dtype(self.terms[0][1].dtype)

    @property
    def device(self) -> torch.device:
        return self.terms[0][1].device

    def use_ghost(self) -> bool:
        """Mixed ghost clipping's rule: Gram matrices when 2 T^2 < p d, else materialise."""
        return ghost_is_cheaper(self.positions, self.rows, self.cols)

    # -- norms
    def sq_norms(self, method: str | None = None) -> torch.Tensor:
        """Squared Frobenius norm of each example's gradient, float32 [B].

        method: "ghost" (Gram matrices), "explicit" (materialise), or None to pick the cheaper.
        """
        if method not in (None, "ghost", "explicit"):
            raise ValueError(f"method must be 'ghost', 'explicit' or None, got {method!r}")
        ghost = self.use_ghost() if method is None else method == "ghost"
        if not ghost:
            return self.materialize().flatten(1).pow(2).sum(1).float()
        total = None
        for k, (xk, yk) in enumerate(self.terms):
            xk, yk = _up(xk, self.dtype), _up(yk, self.dtype)
            for j in range(k, len(self.terms)):
                xj, yj = (_up(t, self.dtype) for t in self.terms[j])
                s = (_gram(xk, xj, self.dtype) * _gram(yk, yj, self.dtype)).sum((1, 2))
                s = s if j == k else 2 * s
                total = s if total is None else total + s
        return total.float()

    # -- sums
    def weighted_sum(self, weights: torch.Tensor) -> torch.Tensor:
        """``sum_i w_i G_i`` in param_shape, one product per term (book-keeping)."""
        w = weights.to(self.dtype)
        out = None
        for x, y in self.terms:
            x, y = _up(x, self.dtype), y.to(self.dtype)
            wy = y * w[:, None, None]
            if isinstance(x, OneHot):
                part = y.new_zeros(self.rows, self.cols)
                part.index_add_(0, x.ids.reshape(-1), wy.reshape(-1, self.cols))
            else:
                part = torch.einsum("btr,btc->rc", x, wy)
            out = part if out is None else out + part
        return out.view(self.param_shape)

    def sum(self, dim: int = 0) -> torch.Tensor:
        if dim != 0:
            raise ValueError("OuterGrad only sums over the batch axis (dim=0)")
        return self.weighted_sum(torch.ones(self.batch_size, device=self.device))

    def materialize(self) -> torch.Tensor:
        """Explicit per-example gradients [B, *param_shape]."""
        b = self.batch_size
        out = None
        for x, y in self.terms:
            x, y = _up(x, self.dtype), y.to(self.dtype)
            if isinstance(x, OneHot):
                flat = y.new_zeros(b * self.rows, self.cols)
                offset = torch.arange(b, device=y.device)[:, None] * self.rows
                flat.index_add_(0, (x.ids + offset).reshape(-1), y.reshape(-1, self.cols))
                part = flat.view(b, self.rows, self.cols)
            else:
                part = torch.einsum("btr,btc->brc", x, y)
            out = part if out is None else out + part
        return out.view(b, *self.param_shape)

    # -- accumulation (module called twice, tied weights)
    def __add__(self, other: object) -> OuterGrad | torch.Tensor:
        if isinstance(other, OuterGrad):
            if other.param_shape.numel() != self.param_shape.numel() or other.rows != self.rows:
                raise UnsupportedLayerError(
                    "a weight shared between layers that use it with different layouts; "
                    "untie it or freeze it"
                )
            return OuterGrad(self.terms + other.terms, self.param_shape)
        if isinstance(other, torch.Tensor):
            return self.materialize() + other.view(self.shape)
        return NotImplemented

    __radd__ = __add__

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        """`tensor + OuterGrad` (explicit and factored uses of one tied weight)."""
        if func in (torch.Tensor.add, torch.Tensor.__add__, torch.add) and len(args) == 2:
            a, b = args
            return (b + a) if isinstance(b, OuterGrad) else (a + b)
        return NotImplemented


def ghost_is_cheaper(positions: int, rows: int, cols: int) -> bool:
    """Mixed ghost clipping's per-layer rule (Bu et al. 2022): the two T x T Gram matrices
    (~2 T^2 per example) against the materialised [rows, cols] gradient."""
    return 2 * positions**2 < rows * cols


def settle(grad: OuterGrad) -> OuterGrad | torch.Tensor:
    """Keep the factors where ghost norms are cheaper, else materialise now (module docstring)."""
    return grad if grad.use_ghost() else grad.materialize()


def is_factored(g: object) -> bool:
    return isinstance(g, OuterGrad)


def batch_size_of(g: torch.Tensor | OuterGrad) -> int:
    return g.shape[0]


# --------------------------------------------------------------------------- registry
_NORM_SAMPLERS: dict[type | str, WeightSampler] = {}


def register_norm_sampler(*layers: type | str) -> Callable[[WeightSampler], WeightSampler]:
    """Register a full-mode weight sampler that may return :class:`OuterGrad` values."""

    def deco(fn: WeightSampler) -> WeightSampler:
        for layer in layers:
            _NORM_SAMPLERS[layer] = fn
        return fn

    return deco


def norm_sampler_for(module: nn.Module) -> WeightSampler | None:
    for cls in type(module).__mro__:
        fn = _NORM_SAMPLERS.get(cls) or _NORM_SAMPLERS.get(_qualname(cls))
        if fn is not None:
            return fn
    return None


def _rows(t: torch.Tensor, batch_dim: int) -> torch.Tensor:
    """[B, T, features] with every axis between batch and features flattened into T."""
    t = move_batch_first(t, batch_dim)
    return t.reshape(t.shape[0], -1, t.shape[-1])


# --------------------------------------------------------------------------- linear layers
@register_norm_sampler(nn.Linear)
def linear_outer(layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, bd: int):
    grad = OuterGrad(((_rows(grad_output, bd), _rows(inputs, bd)),), layer.weight.shape)
    return {"weight": settle(grad)}


@register_norm_sampler(HF_CONV1D)
def hf_conv1d_outer(layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, bd: int):
    grad = OuterGrad(((_rows(inputs, bd), _rows(grad_output, bd)),), layer.weight.shape)
    return {"weight": settle(grad)}


# --------------------------------------------------------------------------- embedding
def _check_embedding(layer: nn.Embedding) -> None:
    if layer.scale_grad_by_freq or layer.sparse:
        raise UnsupportedLayerError(
            "nn.Embedding with scale_grad_by_freq=True or sparse=True: the first scales each "
            "example's gradient by counts over the whole batch (not per-example), the second "
            "yields sparse gradients. Build the embedding without them, or freeze it."
        )


def embedding_factors(
    layer: nn.Embedding, inputs: torch.Tensor, grad_output: torch.Tensor, bd: int
) -> tuple[OneHot, torch.Tensor]:
    _check_embedding(layer)
    ids = move_batch_first(inputs, bd)
    ids = ids.reshape(ids.shape[0], -1)
    g = _rows(grad_output, bd)
    if layer.padding_idx is not None:  # that row never receives a gradient
        g = g * (ids != layer.padding_idx).unsqueeze(-1).to(g.dtype)
    return OneHot(ids, layer.num_embeddings), g


@register_norm_sampler(nn.Embedding)
def embedding_outer(layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, bd: int):
    x, y = embedding_factors(layer, inputs, grad_output, bd)
    return {"weight": settle(OuterGrad(((x, y),), layer.weight.shape))}


# --------------------------------------------------------------------------- convolutions
def _pairs(v: int | tuple[int, ...], n: int) -> tuple[int, ...]:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * n


_CONV_DIMS = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}


def _spatial_dims(layer: nn.Module) -> int:
    for cls, n in _CONV_DIMS.items():
        if isinstance(layer, cls):
            return n
    raise UnsupportedLayerError(f"{type(layer).__name__} is not Conv1d, Conv2d or Conv3d")


def conv_patches(layer: nn.Conv1d | nn.Conv2d | nn.Conv3d, x: torch.Tensor) -> torch.Tensor:
    """Unfolded input patches [B, C_in * prod(kernel), L], in the weight's (C, k...) order.

    Read as a strided view of the (padded) input and copied once by the reshape: on CPU two to
    four times faster than F.unfold's im2col for the same tensor, and it covers 3-d kernels."""
    n = _spatial_dims(layer)
    k = _pairs(layer.kernel_size, n)
    s = _pairs(layer.stride, n)
    d = _pairs(layer.dilation, n)
    if isinstance(layer.padding, str):
        if layer.padding == "valid":
            pads = [(0, 0)] * n
        else:  # "same" (stride 1): torch puts the extra element on the right
            pads = []
            for ki, di in zip(k, d, strict=True):
                total = di * (ki - 1)
                pads.append((total // 2, total - total // 2))
    else:
        pads = [(p, p) for p in _pairs(layer.padding, n)]
    flat_pad = [v for pair in reversed(pads) for v in pair]  # F.pad wants last dim first
    if any(flat_pad):
        mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
        x = F.pad(x, flat_pad, mode=mode)
    b, c, *size = x.shape
    out = [(size[i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(n)]
    st = x.stride()
    view = x.as_strided(
        (b, c, *k, *out),
        (
            st[0],
            st[1],
            *(st[2 + i] * d[i] for i in range(n)),
            *(st[2 + i] * s[i] for i in range(n)),
        ),
    )
    return view.reshape(b, c * math.prod(k), math.prod(out))


def _check_conv(layer: nn.Module, inputs: torch.Tensor) -> None:
    expected = 2 + _spatial_dims(layer)
    if inputs.dim() != expected:
        raise UnsupportedLayerError(
            f"{type(layer).__name__} got an unbatched input (rank {inputs.dim()}); dpfit needs "
            "a batch axis to separate examples"
        )


@register_weight_sampler(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_weight(layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, bd: int):
    """Explicit per-example conv weight gradients (any groups): one batched product of the
    output gradient [B, O, L] with the unfolded patches [B, C*K, L] per group, computed in the
    accumulation dtype (float32 for a half-precision model)."""
    _check_conv(layer, inputs)
    dt = accumulation_dtype(grad_output.dtype)
    b, groups = inputs.shape[0], layer.groups
    cols = conv_patches(layer, inputs.to(dt))  # [B, C*K, L]
    positions = cols.shape[-1]
    g = grad_output.to(dt).reshape(b, layer.out_channels, positions)  # [B, O, L]
    if groups == 1:
        per = torch.bmm(g, cols.transpose(1, 2))  # [B, O, C*K]
    else:
        cols = cols.view(b, groups, -1, positions)  # [B, G, Cg*K, L]
        per = torch.matmul(g.view(b, groups, -1, positions), cols.transpose(2, 3))
    return {"weight": per.reshape(b, *layer.weight.shape)}


def conv_factors(layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, bd: int):
    """The factored gradient (output gradient, unfolded patches) for ghost norms (groups 1)."""
    _check_conv(layer, inputs)
    b = inputs.shape[0]
    cols = conv_patches(layer, inputs).transpose(1, 2)  # [B, L, C*K]
    g = grad_output.reshape(b, layer.out_channels, -1).transpose(1, 2)  # [B, L, O]
    return {"weight": OuterGrad(((g, cols),), layer.weight.shape)}


@register_norm_sampler(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_outer(layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, bd: int):
    """Ghost norms (factors kept) when ``2 L^2 < O * C * K`` with L output positions, else the
    per-example gradients at once (see the module docstring); grouped convs: always explicit.

    The rule (ghost_is_cheaper, as in `settle`) is applied here, before the patches exist, not
    by `settle(conv_factors(...))`: the factors are unfolded in the model's dtype, and
    materialising them would then cast the patches, K times the input, where conv_weight casts
    the input before unfolding. The results are the same either way (bitwise), and so is
    float32 memory, but for a bf16 model with k x k kernels that route holds more tensor
    memory at its peak (benchmarks/archive/conv_settle.py)."""
    if layer.groups != 1:
        return conv_weight(layer, inputs, grad_output, bd)
    positions = grad_output[0].numel() // layer.out_channels
    if ghost_is_cheaper(positions, layer.out_channels, layer.weight[0].numel()):
        return conv_factors(layer, inputs, grad_output, bd)
    return conv_weight(layer, inputs, grad_output, bd)

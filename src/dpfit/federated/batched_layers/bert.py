"""BERT-style encoders (``backbone.encoder.layer``): the layer math every BERT family shares
(``BertFamily``: one encoder layer over its name prefix, pooling, head), and local mode
``lora-top`` (``BertTop``): LoRA on the top layer's query/value, that layer's biases and the
head train; the layers below are frozen."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpfit.federated.batched_layers.base import BatchedEngineError, Linear, TrainedTop
from dpfit.federated.client import LocalModel, top_layer_prefix

POOLER = "backbone.pooler.dense"


@dataclass(frozen=True)
class BertLayer:
    """Names of one encoder layer's parameters (LayerNorms as (weight, bias))."""

    q: Linear
    k: Linear
    v: Linear
    o: Linear
    ln1: tuple[str, str]
    i: Linear
    o2: Linear
    ln2: tuple[str, str]


class BertFamily(TrainedTop):
    """Shared by the BERT families: checks, parameter lookup (a stacked client tensor if it
    trains, else the frozen weight), one encoder layer by name prefix, pooling and head."""

    def __init__(self, lm: LocalModel) -> None:
        super().__init__(lm)
        net = lm.model
        if not hasattr(getattr(net.backbone, "encoder", None), "layer"):
            raise BatchedEngineError("not a BERT-style encoder (backbone.encoder.layer)")
        if net.pooling not in ("mean", "cls", "pooler"):
            raise BatchedEngineError(
                f"the batched engine supports mean, cls or pooler pooling, not {net.pooling!r}"
            )
        self.pooling = net.pooling
        self.pooler = getattr(net.backbone, "pooler", None)
        cfg = net.config
        if cfg.hidden_act != "gelu":
            raise BatchedEngineError(f"hidden_act {cfg.hidden_act!r}: the engine implements gelu")
        self.heads = cfg.num_attention_heads
        self.eps = cfg.layer_norm_eps
        self.named = dict(net.named_parameters())
        self.trainable = list(lm.trainable)
        self.head = Linear("head.weight", "head.bias")
        # a pooler whose bias trains (bias mode) runs per client; a frozen one as the module
        self.pooler_linear = (
            self._linear(POOLER, self.pooler.dense)
            if self.pooling == "pooler" and f"{POOLER}.bias" in self.trainable
            else None
        )
        if self.pooler_linear is not None and not isinstance(self.pooler.activation, torch.nn.Tanh):
            raise BatchedEngineError("the engine implements a BERT pooler with tanh only")

    def _linear(self, path: str, module: torch.nn.Module) -> Linear:
        if hasattr(module, "base_layer"):  # peft LoRA wrapper
            scaling = float(module.scaling["default"])
            return Linear(
                self._name(f"{path}.base_layer.weight"),
                self._name(f"{path}.base_layer.bias"),
                self._name(f"{path}.lora_A.default.weight"),
                self._name(f"{path}.lora_B.default.weight"),
                scaling,
            )
        return Linear(self._name(f"{path}.weight"), self._name(f"{path}.bias"))

    def _layer_names(self, index: int) -> BertLayer:
        """The names of encoder layer ``index`` (``backbone.encoder.layer.<index>.``)."""
        prefix = f"backbone.encoder.layer.{index}."
        layer = self.lm.model.backbone.encoder.layer[index]
        attn = layer.attention
        return BertLayer(
            q=self._linear(prefix + "attention.self.query", attn.self.query),
            k=self._linear(prefix + "attention.self.key", attn.self.key),
            v=self._linear(prefix + "attention.self.value", attn.self.value),
            o=self._linear(prefix + "attention.output.dense", attn.output.dense),
            ln1=(
                self._name(prefix + "attention.output.LayerNorm.weight"),
                self._name(prefix + "attention.output.LayerNorm.bias"),
            ),
            i=self._linear(prefix + "intermediate.dense", layer.intermediate.dense),
            o2=self._linear(prefix + "output.dense", layer.output.dense),
            ln2=(
                self._name(prefix + "output.LayerNorm.weight"),
                self._name(prefix + "output.LayerNorm.bias"),
            ),
        )

    def _norm(self, x: torch.Tensor, names: tuple[str, str], params) -> torch.Tensor:
        w, b = self._get(names[0], params), self._get(names[1], params)
        y = F.layer_norm(x, x.shape[-1:], eps=self.eps) * w
        return y + (b if b.dim() == 1 else b[:, None, :])

    def _encoder_layer(
        self,
        layer: BertLayer,
        x: torch.Tensor,
        batch: int,
        mask: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        projected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One encoder layer: x (K, B*L, H) -> (K, B*L, H); ``batch`` = B, mask (K, B, L) or
        None; ``projected`` (K, B, L, 3H): the cached frozen q, k, v products of x."""
        k, _, width = x.shape
        length = x.shape[1] // batch
        nh, dh = self.heads, width // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(k * batch, length, nh, dh).transpose(1, 2)

        bases = (
            projected.reshape(k, batch * length, 3 * width).split(width, dim=-1)
            if projected is not None
            else (None, None, None)
        )
        q, kk, v = (
            split(self._apply(lin, x, params, base))
            for lin, base in zip((layer.q, layer.k, layer.v), bases, strict=True)
        )
        scores = q @ kk.transpose(-1, -2) / math.sqrt(dh)
        if mask is not None:
            key_mask = mask.reshape(k * batch, 1, 1, length)
            scores = scores + (1.0 - key_mask) * torch.finfo(scores.dtype).min
        ctx = torch.softmax(scores, dim=-1) @ v
        ctx = ctx.transpose(1, 2).reshape(k, batch * length, width)
        a = self._norm(self._apply(layer.o, ctx, params) + x, layer.ln1, params)
        inter = F.gelu(self._apply(layer.i, a, params))
        return self._norm(self._apply(layer.o2, inter, params) + a, layer.ln2, params)

    def _pool_and_head(
        self, out: torch.Tensor, mask: torch.Tensor | None, params: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """out (K, B, L, H) -> logits (K, B, classes)."""
        k, b, length, width = out.shape
        if self.pooling == "mean" and mask is None:
            pooled = out.mean(2)
        elif self.pooling == "mean":
            m = mask.unsqueeze(-1)
            pooled = (out * m).sum(2) / m.sum(2).clamp(min=1.0)
        elif self.pooling == "cls":
            pooled = out[:, :, 0]
        elif self.pooler_linear is not None:  # BERT pooler with per-client bias
            pooled = torch.tanh(self._apply(self.pooler_linear, out[:, :, 0], params))
        else:  # frozen BERT pooler on the first token
            pooled = self.pooler(out.reshape(k * b, length, width)).reshape(k, b, width)
        return self._apply(self.head, pooled, params)


class BertTop(BertFamily):
    """The top BERT layer, pooling and head as a function of stacked client parameters."""

    def __init__(self, lm: LocalModel) -> None:
        super().__init__(lm)
        net = lm.model
        self.prefix = top_layer_prefix(net)
        outside = [n for n in self.trainable if not n.startswith((self.prefix, "head."))]
        if outside:
            raise BatchedEngineError(f"parameters below the top layer train: {outside}")
        self.layer = self._layer_names(len(net.backbone.encoder.layer) - 1)
        qkv = (self.layer.q.weight, self.layer.k.weight, self.layer.v.weight)
        # the frozen q, k, v weights stacked (FrozenCache.project); None if any of them trains
        self.qkv_weight = (
            None
            if any(n in self.trainable for n in qkv)
            else torch.cat([self.named[n].detach() for n in qkv])
        )

    def frozen_hidden(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        backbone = self.lm.model.backbone
        layers = backbone.encoder.layer
        backbone.encoder.layer = layers[:-1]  # the frozen part only; restored below
        try:
            return backbone(**batch).last_hidden_state
        finally:
            backbone.encoder.layer = layers

    def logits(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        projected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden (K, B, L, H), mask (K, B, L) or None (no padding) -> logits (K, B, classes).

        ``projected`` (K, B, L, 3H): the cached frozen q, k, v products of ``hidden``.
        """
        k, b, length, width = hidden.shape
        x = hidden.reshape(k, b * length, width)
        out = self._encoder_layer(self.layer, x, b, mask, params, projected)
        return self._pool_and_head(out.reshape(k, b, length, width), mask, params)

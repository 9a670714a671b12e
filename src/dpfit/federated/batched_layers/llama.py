"""LLaMA-style decoders (``backbone.layers``, e.g. the bundled SmolLM2), local mode
``lora-top``: LoRA on the top decoder layer's q_proj/v_proj, that layer's biases (LLaMA has
none) and the head train; the layers below are frozen.

The top layer is written out by hand on stacked client tensors: RMSNorm, q/k/v projections
(per-client LoRA), rotary embeddings (the model's own ``rotary_emb``, so any rope type it
implements), grouped-query attention under the causal mask, o_proj, RMSNorm, the gated MLP,
the final norm, pooling and the head. Only the pooled positions' outputs reach the head, and
in a causal layer a position's output depends only on its own query, so queries, o_proj and
the MLP run at those positions only (one token for the decoder's last-token pooling); keys
and values run at every position. The texts arrive unpadded (positions 0..L-1), as the full
model sees them with right padding.
"""

from __future__ import annotations

import torch

from dpfit.federated.batched_layers.base import BatchedEngineError, Linear, TrainedTop
from dpfit.federated.client import LocalModel, top_layer_prefix

MODEL_TYPES = ("llama",)  # checked layer by layer against this module's arithmetic
POOLINGS = ("last", "mean", "cls")


class LlamaTop(TrainedTop):
    """The top LLaMA decoder layer, final norm, pooling and head on stacked parameters."""

    def __init__(self, lm: LocalModel) -> None:
        super().__init__(lm)
        net = lm.model
        cfg = net.config
        if getattr(cfg, "model_type", None) not in MODEL_TYPES:
            raise BatchedEngineError(
                f"the batched engine's decoder family runs model types {MODEL_TYPES}, got "
                f"{getattr(cfg, 'model_type', None)!r}; use --engine local for it"
            )
        self.prefix = top_layer_prefix(net)
        if net.pooling not in POOLINGS:
            raise BatchedEngineError(
                f"the batched engine supports {', '.join(POOLINGS)} pooling for decoders, "
                f"not {net.pooling!r}"
            )
        self.pooling = net.pooling
        backbone = net.backbone
        self.rotary = backbone.rotary_emb
        layer = backbone.layers[-1]
        attn = layer.self_attn
        self.act = layer.mlp.act_fn  # frozen and stateless: the model's own activation
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scale = float(attn.scaling)
        self.eps = float(cfg.rms_norm_eps)
        self.named = dict(net.named_parameters())
        self.trainable = list(lm.trainable)
        self.q = self._linear("self_attn.q_proj", attn.q_proj)
        self.k = self._linear("self_attn.k_proj", attn.k_proj)
        self.v = self._linear("self_attn.v_proj", attn.v_proj)
        self.o = self._linear("self_attn.o_proj", attn.o_proj)
        self.gate = self._linear("mlp.gate_proj", layer.mlp.gate_proj)
        self.up = self._linear("mlp.up_proj", layer.mlp.up_proj)
        self.down = self._linear("mlp.down_proj", layer.mlp.down_proj)
        self.ln1 = self._name(self.prefix + "input_layernorm.weight")
        self.ln2 = self._name(self.prefix + "post_attention_layernorm.weight")
        self.final = self._name("backbone.norm.weight")
        self.head = Linear("head.weight", "head.bias")
        known = {self.ln1, self.ln2, self.final, "head.weight", "head.bias"}
        for lin in (self.q, self.k, self.v, self.o, self.gate, self.up, self.down):
            known |= {n for n in (lin.weight, lin.bias, lin.lora_a, lin.lora_b) if n}
        unknown = [n for n in self.trainable if n not in known]
        if unknown:
            raise BatchedEngineError(
                f"parameters outside the top decoder layer's q/k/v/o, MLP and the head train: "
                f"{unknown}; use --engine local"
            )
        # q/k/v read the RMS-normed input, not the cached one: no cached products
        self.qkv_weight = None

    def frozen_hidden(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The input of the top layer: the backbone without its top layer and final norm
        (both restored below), with the batch's own mask and position ids."""
        backbone = self.lm.model.backbone
        layers, norm = backbone.layers, backbone.norm
        backbone.layers, backbone.norm = layers[:-1], torch.nn.Identity()
        try:
            return backbone(**batch).last_hidden_state
        finally:
            backbone.layers, backbone.norm = layers, norm

    def _linear(self, path: str, module: torch.nn.Module) -> Linear:
        """Names of one projection (bias None where it has none, as in LLaMA)."""
        base = f"{self.prefix}{path}.base_layer." if hasattr(module, "base_layer") else None
        own = base or f"{self.prefix}{path}."
        bias = own + "bias" if own + "bias" in self.named else None
        if base is None:
            return Linear(self._name(own + "weight"), bias)
        return Linear(
            self._name(own + "weight"),
            bias,
            self._name(f"{self.prefix}{path}.lora_A.default.weight"),
            self._name(f"{self.prefix}{path}.lora_B.default.weight"),
            float(module.scaling["default"]),
        )

    def _rms(self, x: torch.Tensor, name: str, params) -> torch.Tensor:
        """LlamaRMSNorm, with its float32 statistics (so a float64 model matches it)."""
        w = self._get(name, params)
        y = x.to(torch.float32)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (w if w.dim() == 1 else w[:, None, :]) * y.to(x.dtype)

    @staticmethod
    def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        rotated = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
        return t * cos + rotated * sin

    def _query_positions(
        self, kb: int, length: int, mask: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor:
        """(K*B, Lq): the positions whose outputs the pooling reads."""
        if self.pooling == "mean":
            return torch.arange(length, device=device).expand(kb, length)
        if self.pooling == "cls":
            return torch.zeros(kb, 1, dtype=torch.long, device=device)
        if mask is None:
            return torch.full((kb, 1), length - 1, dtype=torch.long, device=device)
        positions = torch.arange(length, device=device)
        return (mask.reshape(kb, length).long() * positions).argmax(1, keepdim=True)

    def logits(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        projected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden (K, B, L, H), mask (K, B, L) with right padding (1 = token) or None (no
        padding) -> logits (K, B, classes). ``projected`` is unused (None)."""
        k, b, length, width = hidden.shape
        kb, nh, nkv, dh = k * b, self.heads, self.kv_heads, self.head_dim
        x = hidden.reshape(k, b * length, width)
        normed = self._rms(x, self.ln1, params)
        positions = torch.arange(length, device=hidden.device)
        qpos = self._query_positions(kb, length, mask, hidden.device)  # (kb, Lq)
        lq = qpos.shape[1]
        x_q = x.reshape(kb, length, width).gather(1, qpos[..., None].expand(-1, -1, width))
        n_q = normed.reshape(kb, length, width).gather(1, qpos[..., None].expand(-1, -1, width))
        x_q, n_q = x_q.reshape(k, b * lq, width), n_q.reshape(k, b * lq, width)
        with torch.no_grad():  # right padding: real tokens sit at positions 0..n-1
            cos, sin = self.rotary(hidden, positions[None])  # (1, L, dh)
        q = self._apply(self.q, n_q, params).reshape(kb, lq, nh, dh).transpose(1, 2)
        kk = self._apply(self.k, normed, params).reshape(kb, length, nkv, dh).transpose(1, 2)
        v = self._apply(self.v, normed, params).reshape(kb, length, nkv, dh).transpose(1, 2)
        q = self._rotate(q, cos[0][qpos][:, None], sin[0][qpos][:, None])
        kk = self._rotate(kk, cos[:, None], sin[:, None])
        # grouped-query attention: query head i reads key/value head i // (nh / nkv)
        groups = nh // nkv
        q = q.reshape(kb, nkv, groups, lq, dh)
        scores = q @ kk[:, :, None].transpose(-1, -2) * self.scale  # (kb, nkv, g, Lq, L)
        future = positions[None, None, :] > qpos[:, :, None]  # (kb, Lq, L)
        scores = scores.masked_fill(future[:, None, None], float("-inf"))
        ctx = torch.softmax(scores, dim=-1) @ v[:, :, None]  # (kb, nkv, g, Lq, dh)
        ctx = ctx.reshape(kb, nh, lq, dh).transpose(1, 2).reshape(k, b * lq, nh * dh)
        a = self._apply(self.o, ctx, params) + x_q
        m = self._rms(a, self.ln2, params)
        gated = self.act(self._apply(self.gate, m, params)) * self._apply(self.up, m, params)
        out = self._rms(self._apply(self.down, gated, params) + a, self.final, params)
        out = out.reshape(k, b, lq, width)
        if self.pooling != "mean":
            pooled = out[:, :, 0]
        elif mask is None:
            pooled = out.mean(2)
        else:
            w = mask.to(out.dtype).unsqueeze(-1)
            pooled = (out * w).sum(2) / w.sum(2).clamp(min=1.0)
        return self._apply(self.head, pooled, params)

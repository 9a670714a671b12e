"""BERT-style encoders, local mode ``bias`` (DP-BiTFiT clients): every bias of the model and
the head train, the embeddings' LayerNorm bias included, so the only frozen part is the sum
of the word, position and token-type embeddings before that LayerNorm. From there every
layer runs per client: the embedding LayerNorm, all encoder layers (``BertFamily``'s layer
math, each reading its client's biases), pooling (a trained pooler's bias too) and head."""

from __future__ import annotations

import torch

from dpfit.federated.batched_layers.base import BatchedEngineError
from dpfit.federated.batched_layers.bert import BertFamily
from dpfit.federated.client import LocalModel

EMBEDDINGS = "backbone.embeddings"


class BertBias(BertFamily):
    """Embedding LayerNorm, every encoder layer, pooling and head as a function of stacked
    client biases (and head); the frozen weights are shared by every client."""

    def __init__(self, lm: LocalModel) -> None:
        encoder = getattr(getattr(lm.model, "backbone", None), "encoder", None)
        emb = getattr(getattr(lm.model, "backbone", None), "embeddings", None)
        parts = ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm")
        if (
            encoder is None
            or not hasattr(encoder, "layer")
            or not all(hasattr(emb, p) for p in parts)
        ):
            raise BatchedEngineError(
                "local mode bias in the batched engine needs a BERT-style model "
                "(backbone.embeddings with word, position and token-type embeddings, "
                "backbone.encoder.layer); use --engine local"
            )
        kind = getattr(lm.model.config, "position_embedding_type", None) or "absolute"
        if kind != "absolute":
            raise BatchedEngineError(
                f"position_embedding_type {kind!r}: the batched engine implements absolute "
                "positions; use --engine local"
            )
        super().__init__(lm)
        self.embedding_norm = (
            self._name(f"{EMBEDDINGS}.LayerNorm.weight"),
            self._name(f"{EMBEDDINGS}.LayerNorm.bias"),
        )
        self.layers = [self._layer_names(i) for i in range(len(encoder.layer))]
        self.qkv_weight = None  # the q/k/v input differs by client in every layer
        used = {n for n in self.embedding_norm}
        for layer in self.layers:
            used |= {layer.ln1[1], layer.ln2[1]}
            used |= {lin.bias for lin in (layer.q, layer.k, layer.v, layer.o, layer.i, layer.o2)}
        if self.pooler_linear is not None:
            used.add(self.pooler_linear.bias)
        used |= {self.head.weight, self.head.bias}
        unknown = [n for n in self.trainable if n not in used]
        if unknown:
            raise BatchedEngineError(
                f"the batched engine does not know where these trainables act: {unknown}; "
                "use --engine local"
            )
        self._check_embeddings()

    @torch.no_grad()
    def _check_embeddings(self) -> None:
        """Refuse a model whose embeddings are not LayerNorm(word + token type + position) as
        ``frozen_hidden`` adds them (RoBERTa counts positions from its padding index, ...):
        its clients would train on wrong inputs. Checked on one tokenized text."""
        emb = self.lm.model.backbone.embeddings
        batch = self.lm.batch(self.lm.encode(["the batched engine checks its inputs"], 16))
        mine = emb.LayerNorm(self.frozen_hidden(batch))
        theirs = emb(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"))
        if mine.shape != theirs.shape or not torch.allclose(mine, theirs, rtol=0, atol=1e-5):
            raise BatchedEngineError(
                f"{type(emb).__name__} does not add word, token-type and position embeddings "
                "as BERT does; local mode bias in the batched engine needs a BERT model, use "
                "--engine local"
            )

    def frozen_hidden(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The word + token-type + position embeddings, before the embedding LayerNorm (as
        ``BertEmbeddings`` adds them; per token, so padding does not change a real token's)."""
        emb = self.lm.model.backbone.embeddings
        ids = batch["input_ids"]
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = emb.position_ids[:, : ids.shape[1]]
        token_type_ids = batch.get("token_type_ids")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(ids)
        out = emb.word_embeddings(ids) + emb.token_type_embeddings(token_type_ids)
        return out + emb.position_embeddings(position_ids)

    def logits(
        self,
        hidden: torch.Tensor,
        mask: torch.Tensor | None,
        params: dict[str, torch.Tensor],
        projected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden (K, B, L, H): the embedding sums; mask (K, B, L) or None (no padding) ->
        logits (K, B, classes). ``projected`` must be None (no layer's q/k/v input is frozen)."""
        if projected is not None:
            raise BatchedEngineError("local mode bias has no frozen q/k/v products to reuse")
        k, b, length, width = hidden.shape
        x = self._norm(hidden.reshape(k, b * length, width), self.embedding_norm, params)
        for layer in self.layers:
            x = self._encoder_layer(layer, x, b, mask, params)
        return self._pool_and_head(x.reshape(k, b, length, width), mask, params)

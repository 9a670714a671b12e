"""transformers' ViTEmbeddings: the [CLS] token and the position embeddings (full mode).

Both are raw parameters of the embedding module, added to the patch embeddings inside its
forward: ``out = dropout(cat(cls, patches) + position_embeddings)``. Without dropout the
per-example gradient of ``position_embeddings`` is the output gradient itself, and that of
``cls_token`` its first row; so the sampler needs only the output gradient. With dropout
active the mask is not visible from the output, so that case is refused with what to do.
"""

from __future__ import annotations

import torch
from torch import nn

from dpfit.errors import UnsupportedLayerError
from dpfit.grad_sample.registry import move_batch_first, register_weight_sampler

VIT_EMBEDDINGS = "transformers.models.vit.modeling_vit.ViTEmbeddings"


@register_weight_sampler(VIT_EMBEDDINGS, params=("cls_token", "position_embeddings"))
def vit_embeddings(
    layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor, batch_dim: int
) -> dict[str, torch.Tensor]:
    if layer.training and layer.dropout.p > 0:
        raise UnsupportedLayerError(
            "ViT embeddings with dropout: per-example gradients of cls_token / "
            "position_embeddings need hidden_dropout_prob=0 in the ViT config (or freeze them)"
        )
    g = move_batch_first(grad_output, batch_dim)
    if g.shape[1] != layer.position_embeddings.shape[1]:
        raise UnsupportedLayerError(
            "ViT embeddings with interpolated position encodings: train at the model's own "
            "image size, or freeze position_embeddings and cls_token"
        )
    return {"position_embeddings": g.unsqueeze(1), "cls_token": g[:, None, :1]}

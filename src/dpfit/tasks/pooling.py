"""A classification head that pools the way the backbone was trained to be read.

Why not ``AutoModelForSequenceClassification``: its head reads a fixed position (BERT: the
[CLS] token through the NSP-trained pooler; GPT-2/LLaMA: the last non-pad token found by
comparing ids with the pad id, which fails when pad = eos). A sentence-transformers model
such as the bundled MiniLM was trained to be read by the *mean* of its token states, and a
linear probe on that mean is far better than on its pooler. So dpfit builds one small head
for every backbone: ``pooled = pool(last_hidden_state, mask)``, ``logits = head(pooled)``.

The head is zero-initialised: the model starts at uniform predictions, so the first noised
steps move the head only along the features' class means instead of first undoing a random
projection (De et al. 2022 zero-init the classifier for DP fine-tuning for this reason), and
the initial logits carry no seed-dependent offset. A zero head also blocks the gradient into
the backbone for exactly one step, after which biases and head train together.

Saved layout (``save_pooled_classifier``): the backbone as an ordinary transformers folder
(``AutoModel.from_pretrained`` loads it), ``config.json`` extended with ``dpfit_pooling`` and
the label names, and the head's two tensors in ``dpfit_head.safetensors``. docs/train.md shows
the five lines of plain transformers code that reproduce the logits.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dpfit.errors import DPFitError
from dpfit.saving import save_plain

log = logging.getLogger(__name__)

POOLINGS = ("auto", "cls", "pooler", "mean", "last")
CONFIG_KEY = "dpfit_pooling"
HEAD_FILE = "dpfit_head.safetensors"
HEAD_NAME = "head"
# sentence-transformers pooling modes -> ours
_ST_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}


class PoolingError(DPFitError, ValueError):
    """The pooling asked for does not fit the backbone."""


def sentence_transformers_pooling(folder: str | Path) -> str | None:
    """The pooling a sentence-transformers folder declares (modules.json + its Pooling
    module's config.json), or None if the folder is not one."""
    folder = Path(folder)
    modules = folder / "modules.json"
    if not modules.is_file():
        # the bundled package keeps the transformers files in a `model/` subfolder
        modules = folder.parent / "modules.json"
        if not modules.is_file():
            return None
        folder = folder.parent
    try:
        entries = json.loads(modules.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    for entry in entries:
        if str(entry.get("type", "")).endswith("Pooling"):
            cfg = folder / entry.get("path", "") / "config.json"
            if not cfg.is_file():
                return None
            flags = json.loads(cfg.read_text())
            for key, mode in _ST_MODES.items():
                if flags.get(key):
                    return mode
            return "mean"  # max/weighted modes: mean is the closest we offer
    return None


def is_decoder_only(config) -> bool:
    """Decoder-only LMs (GPT-2, LLaMA, ...): a causal-LM class and no masked-LM class."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    mt = getattr(config, "model_type", None)
    return mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mt not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def resolve_pooling(
    requested: str, folder: str | Path | None, config, has_trained_pooler: bool
) -> tuple[str, str]:
    """(pooling, why). `auto`: a sentence-transformers folder's own pooling; the last
    non-pad token for decoders; the pooler of an encoder that has a trained one; else mean."""
    if requested not in POOLINGS:
        raise PoolingError(f"pooling must be one of {POOLINGS}, got {requested!r}")
    if requested == "pooler" and not has_trained_pooler:
        raise PoolingError(
            "--pooling pooler: this backbone has no trained pooler; use mean, cls or last"
        )
    if requested != "auto":
        return requested, "--pooling"
    st = sentence_transformers_pooling(folder) if folder is not None else None
    if st is not None:
        return st, "sentence-transformers folder (its Pooling config)"
    if is_decoder_only(config):
        return "last", "decoder: last non-pad token"
    if has_trained_pooler:
        return "pooler", "encoder with a trained pooler"
    return "mean", "encoder without a trained pooler: mean of token states"


def pool(hidden: torch.Tensor, mask: torch.Tensor | None, how: str, pooler_output=None):
    """(batch, length, width) -> (batch, width). `mask` is the attention mask (1 = token)."""
    if how == "pooler":
        return pooler_output
    if mask is None:
        mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
    if how == "cls":
        return hidden[:, 0]
    if how == "mean":
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)
    if how == "last":
        # the last position whose mask is 1: right padding (…tok pad pad) and left padding
        # (pad pad tok…) alike
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = (mask.long() * positions).argmax(1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise PoolingError(f"unknown pooling {how!r}")


class PooledClassifier(nn.Module):
    """backbone -> pooling -> linear head; ``model(**batch)`` gives ``.logits`` (and ``.loss``
    with ``labels``: the mean of per-example cross-entropies, as DP-SGD needs)."""

    def __init__(self, backbone: nn.Module, num_labels: int, pooling: str):
        super().__init__()
        if pooling not in POOLINGS[1:]:
            raise PoolingError(f"pooling must be one of {POOLINGS[1:]}, got {pooling!r}")
        self.backbone = backbone
        self.pooling = pooling
        width = backbone.config.hidden_size
        self.head = nn.Linear(width, num_labels)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        if pooling != "pooler" and getattr(backbone, "pooler", None) is not None:
            backbone.pooler = None  # unused: would be a trainable bias without a gradient

    @property
    def config(self):
        return self.backbone.config

    def features(self, input_ids, attention_mask=None, **kw) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **kw)
        pooled = pool(
            out.last_hidden_state, attention_mask, self.pooling, getattr(out, "pooler_output", None)
        )
        return pooled

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ):
        from transformers.modeling_outputs import SequenceClassifierOutput

        kw = {}
        if token_type_ids is not None:
            kw["token_type_ids"] = token_type_ids
        if position_ids is not None:
            kw["position_ids"] = position_ids
        # features in the head's dtype: float32 (its master copy) under bf16 compute, the
        # model's own in a float64 model (the oracle tests)
        features = self.features(input_ids, attention_mask, **kw)
        logits = self.head(features.to(self.head.weight.dtype))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)


def has_trained_pooler(backbone: nn.Module, missing_keys) -> bool:
    """The backbone has a pooler whose weights came from the checkpoint."""
    if getattr(backbone, "pooler", None) is None:
        return False
    return not any(".pooler." in f".{k}" or k.startswith("pooler.") for k in missing_keys)


def save_pooled_classifier(model: PooledClassifier, tokenizer, folder: str | Path) -> None:
    """Backbone folder + config (pooling, labels) + head tensors; see the module docstring."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = model.backbone.config
    setattr(config, CONFIG_KEY, model.pooling)
    save_plain(model.backbone, folder)
    tokenizer.save_pretrained(folder)
    head = {k: v.detach().cpu().contiguous() for k, v in model.head.state_dict().items()}
    save_file(head, str(folder / HEAD_FILE), metadata={"pooling": model.pooling})


def is_pooled_classifier_folder(folder: str | Path) -> bool:
    return (Path(folder) / HEAD_FILE).is_file()


def load_head(model: PooledClassifier, folder: str | Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(Path(folder) / HEAD_FILE))
    model.head.load_state_dict(state)

"""Saving a backbone as a plain transformers folder, whatever it was loaded from."""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)


def save_plain(model, folder: str | os.PathLike) -> None:
    """``save_pretrained``, or for a model loaded from GGUF (transformers refuses to save a
    "quantised" model) the dequantised tensors and a config without the quantisation entry."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if getattr(model, "hf_quantizer", None) is None:
        model.save_pretrained(folder)
        return
    from safetensors.torch import save_model

    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    type(model.config).from_dict(config).save_pretrained(folder)
    logger.info("saved a dequantised copy of the GGUF model to %s", folder)

"""Private image classification: image data, a model factory without BatchNorm, public
pretraining and private fine-tuning (DP-BiTFiT, DP full, DP last-layer, two-phase).

Names are imported lazily so that building the CLI parser does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ImageData": "data",
    "load_images": "data",
    "public_private_split": "data",
    "ImageModel": "models",
    "build_model": "models",
    "load_image_model": "models",
    "save_image_model": "models",
    "VisionConfig": "run",
    "evaluate_images": "run",
    "train_images": "run",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"dpfit.vision.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'dpfit.vision' has no attribute {name!r}")

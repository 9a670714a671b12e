"""Private image classification: image data, a model factory without BatchNorm, public
pretraining and private fine-tuning (DP-BiTFiT, DP full, DP last-layer, two-phase) through
the one training loop (the task plug-in :mod:`dpfit.tasks.image_classification`).

Names are imported lazily so that building the CLI parser does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ImageData": "dpfit.vision.data",
    "load_images": "dpfit.vision.data",
    "public_private_split": "dpfit.vision.data",
    "ImageModel": "dpfit.vision.models",
    "pretrain": "dpfit.vision.pretrain",
    "pretrain_epochs": "dpfit.vision.pretrain",
    "build_model": "dpfit.vision.models",
    "load_image_model": "dpfit.vision.models",
    "save_image_model": "dpfit.vision.models",
    # training runs through dpfit.train.train with task="image-classification"
    "ImageOptions": "dpfit.tasks.image_classification",
    "evaluate_images": "dpfit.tasks.image_classification",
    "predict_images": "dpfit.tasks.image_classification",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dpfit.vision' has no attribute {name!r}")

"""Private image classification: image data, a model factory without BatchNorm, public
pretraining and private fine-tuning (DP-BiTFiT, DP full, DP last-layer, two-phase)."""

from dpfit.vision.data import ImageData, load_images, public_private_split
from dpfit.vision.models import ImageModel, build_model, load_image_model, save_image_model
from dpfit.vision.run import VisionConfig, evaluate_images, train_images

__all__ = [
    "ImageData",
    "ImageModel",
    "VisionConfig",
    "build_model",
    "evaluate_images",
    "load_image_model",
    "load_images",
    "public_private_split",
    "save_image_model",
    "train_images",
]

"""The published architecture comes from public inputs only: one colour,
odd-sized image added to a greyscale image folder changes no published value of the model
(dpfit-vision.json, the metrics' image_size) and no weight shape."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from image_tasks import patterns

from dpfit.tasks.image_classification import ImageClassificationTask, ImageOptions
from dpfit.train import TrainConfig
from dpfit.vision.data import FOLDER_CHANNELS, FOLDER_IMAGE_SIZE

TASK = "image-classification"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(greyscale 28x28 folder, the same plus one RGB 60x45 image that sorts first)."""
    from PIL import Image

    grey = tmp_path_factory.mktemp("grey")
    images, labels = patterns(40, 28)
    for i, (img, y) in enumerate(zip(images, labels % 2, strict=True)):
        (grey / f"c{y}").mkdir(exist_ok=True)
        Image.fromarray(img).save(grey / f"c{y}" / f"{i:03d}.png")
    colour = tmp_path_factory.mktemp("colour") / "data"
    shutil.copytree(grey, colour)
    rgb = np.random.default_rng(0).integers(0, 256, (45, 60, 3), dtype=np.uint8)
    Image.fromarray(rgb, "RGB").save(colour / "c0" / "000-first.png")
    return grey, colour


def _published(data, tmp_path, **options) -> tuple[dict, dict, int]:
    """(dpfit-vision.json less its record, weight shapes, image_size in the metrics)."""
    config = TrainConfig(
        task=TASK, data=str(data), model="resnet-gn", labels=("c0", "c1"), epsilon=None,
        noise_multiplier=1.0, task_options=ImageOptions(**options),
    )  # fmt: skip
    task = ImageClassificationTask()
    prep = task.prepare(config)
    folder = tmp_path / f"model-{data.name}"
    task.save(prep, prep.model, folder)
    spec = json.loads((folder / "dpfit-vision.json").read_text())
    spec.pop("dpfit")
    shapes = {k: tuple(v.shape) for k, v in prep.model.state_dict().items()}
    image_size = prep.state["image_model"].spec.image_size  # TaskPlugin.evaluate publishes it
    train = prep.state["train"]
    assert train.images.shape[1:] == (spec["in_channels"], image_size, image_size)
    return spec, shapes, image_size


def test_one_colour_image_changes_no_published_value_or_weight_shape(folders, tmp_path):
    grey, colour = folders
    a, b = _published(grey, tmp_path), _published(colour, tmp_path)
    assert a == b
    assert a[0]["in_channels"] == FOLDER_CHANNELS and a[2] == FOLDER_IMAGE_SIZE


def test_flags_fix_the_geometry_and_every_image_is_converted_to_it(folders, tmp_path):
    grey, colour = folders
    a = _published(grey, tmp_path, channels=1, image_size=28)
    b = _published(colour, tmp_path, channels=1, image_size=28)
    assert a == b
    assert a[0]["in_channels"] == 1 and a[2] == 28

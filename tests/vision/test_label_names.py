"""Class names are published (saved model, metrics.json): names read from the user's images
pass the rare-label rule of text classification; FashionMNIST's names are public."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from image_tasks import patterns, write_idx

from dpfit.cli import main
from dpfit.errors import DPFitError
from dpfit.tasks.image_classification import ImageOptions, prepare_images
from dpfit.tasks.labels import MIN_PUBLIC_LABEL_COUNT, RareLabelError
from dpfit.train import TrainConfig, train
from dpfit.vision import data as vd

TASK = "image-classification"
RARE = "patient-4711"


def _folder(root, counts: dict[str, int]):
    """An ImageFolder-layout folder with counts[name] small images per class."""
    from PIL import Image

    images, _ = patterns(sum(counts.values()), 6)
    i = 0
    for name, c in counts.items():
        (root / name).mkdir(parents=True)
        for _ in range(c):
            Image.fromarray(images[i]).save(root / name / f"{i}.png")
            i += 1
    return root


@pytest.fixture
def rare_folder(tmp_path):
    n = MIN_PUBLIC_LABEL_COUNT + 5
    return _folder(tmp_path / "imgs", {"flat": n, "checker": n, RARE: 2})


def test_rare_folder_class_is_refused_unless_declared_public(rare_folder, tmp_path):
    base = dict(task=TASK, data=str(rare_folder), noise_multiplier=1.0, max_steps=1,
                batch_size=16, physical_batch_size=16)  # fmt: skip
    with pytest.raises(RareLabelError, match=f"{RARE}.*--labels"):
        train(TrainConfig(**base))
    # a public label set without the rare name: the data is refused, nothing is published
    with pytest.raises(DPFitError, match=RARE):
        train(TrainConfig(**base, labels=("flat", "checker")))
    out = tmp_path / "run"
    res = train(TrainConfig(**base, public_labels=True, output=str(out)))
    saved = json.loads((out / "model" / "dpfit-vision.json").read_text())
    assert RARE in saved["label_names"]
    assert res.metrics["label_names_source"] == "--public-labels"
    assert res.metrics["label_names_public"] is True


def test_frequent_or_declared_names_pass(tmp_path):
    n = MIN_PUBLIC_LABEL_COUNT
    folder = _folder(tmp_path / "imgs", {"flat": n, "checker": n})
    whole = TrainConfig(task=TASK, data=str(folder), eval_data=str(folder))  # no hold-out
    got = prepare_images(whole, ImageOptions())
    assert got.label_source == "training data (each name frequent)"
    # the gate counts the images that train, not the folder: with 10% held
    # out, or a --max-train-examples subset, fewer than n carry each name
    with pytest.raises(RareLabelError):
        prepare_images(TrainConfig(task=TASK, data=str(folder)), ImageOptions())
    with pytest.raises(RareLabelError):
        prepare_images(dataclasses.replace(whole, max_train_examples=2 * n - 4), ImageOptions())
    # --labels fixes the names and their order, and may name classes the data lacks
    got = prepare_images(
        TrainConfig(task=TASK, data=str(folder), labels=("checker", "flat", "stripes")),
        ImageOptions(),
    )
    assert got.label_source == "--labels"
    assert got.train.label_names == ("checker", "flat", "stripes")


def test_npz_label_ids_read_from_the_data_are_guarded(tmp_path):
    images, _ = patterns(60, 6)
    labels = np.array([0, 1] * 29 + [7, 7])  # ids 2..7 name classes only one file shows
    np.savez(tmp_path / "d.npz", images=images, labels=labels)
    cfg = TrainConfig(task=TASK, data=str(tmp_path / "d.npz"))
    with pytest.raises(RareLabelError, match="7"):
        prepare_images(cfg, ImageOptions())


def test_fashion_mnist_names_are_public_however_few_the_examples(tmp_path, monkeypatch):
    images, labels = patterns(30, 5)
    labels[-1] = 9  # "Ankle boot": one example
    for prefix, n in (("train", 30), ("t10k", 8)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", images[:n])
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", labels[:n])
    monkeypatch.setenv(vd.FASHION_MNIST_ENV, str(tmp_path))
    got = prepare_images(TrainConfig(task=TASK), ImageOptions())
    assert got.label_source == "bundled" and got.train.label_names == vd.FASHION_MNIST_CLASSES


def test_pretrain_on_a_public_share_guards_names_a_public_data_set_does_not(
    rare_folder, tmp_path, capsys
):
    public = dict(task=TASK, data=str(rare_folder), non_private=True)
    # the whole data set declared public: its class names are public with it
    got = prepare_images(TrainConfig(**public), ImageOptions(split="public"))
    assert got.label_source == "public data"
    # a public share of private data: the names come from all of it (the private side too)
    args = ["pretrain", "--data", str(rare_folder), "--public-fraction", "0.5", "--epochs", "1",
            "--threads", "1", "--quiet", "--json", "--output", str(tmp_path / "pre")]  # fmt: skip
    assert main(args) == 2
    assert "--public-labels" in capsys.readouterr().err
    assert main([*args, "--public-labels"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["label_names_source"] == (
        "--public-labels"
    )

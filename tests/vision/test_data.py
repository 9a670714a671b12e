"""Image readers (.npz, ImageFolder, idx), the public/private split, pixel preparation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from image_tasks import CLASSES, patterns, write_idx

from dpfit.vision import data as vd
from dpfit.vision.data import (
    DatasetNotInstalledError,
    ImageCollate,
    ImageDataError,
    load_images,
    public_private_split,
    read_idx,
    to_pixels,
)


def test_npz_gray_and_channels_first(tmp_path):
    images, labels = patterns(20, 6)
    np.savez(tmp_path / "a.npz", images=images, labels=labels)
    a = load_images(tmp_path / "a.npz")
    assert a.images.shape == (20, 1, 6, 6) and a.label_names == ("0", "1", "2", "3")
    rgb = np.repeat(images[:, None], 3, axis=1)
    np.savez(tmp_path / "b.npz", images=rgb, labels=np.array(CLASSES)[labels])
    b = load_images(tmp_path / "b.npz")
    assert b.channels == 3 and b.label_names == tuple(sorted(CLASSES))
    assert [b.label_names[i] for i in b.labels] == [CLASSES[i] for i in labels]


@pytest.mark.parametrize(
    "arrays,match",
    [
        (dict(images=np.zeros((4, 6, 6, 3), np.uint8), labels=np.zeros(4)), "channels last"),
        (dict(images=np.zeros((4, 6, 6), np.uint8)), "lacks arrays"),
        (dict(images=np.full((4, 6, 6), 2.0), labels=np.zeros(4, int)), r"\[0, 1\]"),
        (dict(images=np.zeros((4, 6, 6), np.uint8), labels=np.zeros(3, int)), "3 labels"),
    ],
)
def test_npz_errors_say_what_to_fix(tmp_path, arrays, match):
    np.savez(tmp_path / "x.npz", **arrays)
    with pytest.raises(ImageDataError, match=match):
        load_images(tmp_path / "x.npz")


def test_image_folder(tmp_path):
    from PIL import Image

    images, labels = patterns(12, 6)
    for i, (img, y) in enumerate(zip(images, labels, strict=True)):
        (tmp_path / CLASSES[y]).mkdir(exist_ok=True)
        Image.fromarray(img).save(tmp_path / CLASSES[y] / f"{i}.png")
    Image.fromarray(np.zeros((9, 9), np.uint8)).save(tmp_path / CLASSES[0] / "big.png")
    d = load_images(tmp_path, channels=1, image_size=6)
    assert d.images.shape == (13, 1, 6, 6)  # the odd-sized image is resized
    # without flags: the fixed default geometry, not the images' own
    default = load_images(tmp_path)
    assert default.images.shape == (13, vd.FOLDER_CHANNELS, vd.FOLDER_IMAGE_SIZE,
                                    vd.FOLDER_IMAGE_SIZE)  # fmt: skip
    assert set(d.label_names) <= set(CLASSES)
    for img, y in zip(images, labels, strict=True):  # every file landed in its class
        hits = [i for i in range(len(d)) if np.array_equal(d.images[i, 0], img)]
        assert hits and d.label_names[d.labels[hits[0]]] == CLASSES[y]
    with pytest.raises(ImageDataError, match="ImageFolder layout"):
        load_images(tmp_path / CLASSES[0])


def test_idx_files_and_fashion_mnist_reader(tmp_path, monkeypatch):
    images, labels = patterns(10, 5)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", images)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", labels)
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images[:4])
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", labels[:4])
    assert np.array_equal(read_idx(tmp_path / "train-images-idx3-ubyte.gz"), images)
    monkeypatch.setenv(vd.FASHION_MNIST_ENV, str(tmp_path))
    train, test = load_images("fashion-mnist"), load_images(None, "test")
    assert train.images.shape == (10, 1, 5, 5) and len(test) == 4
    assert np.array_equal(train.labels, labels) and train.label_names[9] == "Ankle boot"
    (tmp_path / "bad-images-idx3-ubyte").write_bytes(b"\x00\x00\x08\x03" + b"\x00\x00\x00\x02" * 3)
    with pytest.raises(ImageDataError, match="truncated"):
        read_idx(tmp_path / "bad-images-idx3-ubyte")


def test_missing_fashion_mnist_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(vd, "FASHION_MNIST_DIRS", (str(tmp_path / "none"),))
    monkeypatch.delenv(vd.FASHION_MNIST_ENV, raising=False)
    with pytest.raises(DatasetNotInstalledError, match="apt-get install dataset-fashion-mnist"):
        load_images(None)


def test_public_split_is_seeded_disjoint_and_complete():
    images, labels = patterns(100, 4)
    d = vd.ImageData(images[:, None], labels, CLASSES, "x")
    d.images.flags.writeable = False
    pub, priv = public_private_split(d, 0.1, seed=3)
    pub2, priv2 = public_private_split(d, 0.1, seed=3)
    # each image is public by its own hash: binomially about 10 of 100
    assert len(pub) + len(priv) == 100 and 3 <= len(pub) <= 20
    assert np.array_equal(pub.images, pub2.images) and np.array_equal(priv.labels, priv2.labels)
    rows = {img.tobytes() + bytes([int(y)]) for img, y in zip(d.images, d.labels, strict=True)}
    got_pub = [i.tobytes() + bytes([int(y)]) for i, y in zip(pub.images, pub.labels, strict=True)]
    got_priv = [
        i.tobytes() + bytes([int(y)]) for i, y in zip(priv.images, priv.labels, strict=True)
    ]
    assert set(got_pub).isdisjoint(got_priv) and set(got_pub) | set(got_priv) == rows
    other, _ = public_private_split(d, 0.1, seed=4)
    assert not np.array_equal(other.images, pub.images)


def test_pixels_fixed_normalisation_channels_and_resize():
    x = np.array([[[[0, 255], [255, 0]]]], dtype=np.uint8)
    t = to_pixels(x)
    assert torch.equal(t, torch.tensor([[[[-1.0, 1.0], [1.0, -1.0]]]]))
    big = to_pixels(x, channels=3, size=4)
    assert big.shape == (1, 3, 4, 4) and torch.equal(big[:, 0], big[:, 2])
    with pytest.raises(ImageDataError, match="channels"):
        to_pixels(np.zeros((1, 3, 2, 2), np.uint8), channels=1)
    # one channel: canonical strides, not the channels-last-looking ones elementwise ops leave
    # (convolutions then go channels-last and torch's GroupNorm backward crashes on them)
    assert to_pixels(np.zeros((2, 1, 3, 3), np.uint8)).stride() == (9, 9, 3, 1)
    images, labels = patterns(6, 4)
    b = ImageCollate(vd.ImageData(images[:, None], labels, CLASSES, "x"))([5, 0])
    assert b["pixel_values"].shape == (2, 1, 4, 4) and b["labels"].tolist() == [
        labels[5],
        labels[0],
    ]


def _dots(b: int, size: int = 14) -> torch.Tensor:
    """Model inputs (b, 1, size, size): black, with one white pixel at the centre."""
    x = torch.full((b, 1, size, size), -1.0)
    x[:, :, size // 2, size // 2] = 1.0
    return x


def test_shift_augmentation_moves_each_image_within_its_bound():
    x = _dots(200)
    g = torch.Generator().manual_seed(0)
    out = vd.augment_pixels(x, "shift", generator=g)
    assert out.shape == x.shape and out.is_contiguous() and out.stride(1) == 14 * 14
    pad = max(1, round(vd.SHIFT_FRACTION * 14))
    where = (out[:, 0] == 1.0).nonzero()[:, 1:] - 7  # one white pixel per image, moved
    assert where.shape == (200, 2) and where.abs().max() == pad  # never beyond the bound
    moves = {tuple(w) for w in where.tolist()}
    assert len(moves) == (2 * pad + 1) ** 2  # every shift occurs: images move independently
    assert (out == -1.0).sum() == 200 * (14 * 14 - 1)  # nothing else appears (black padding)
    assert torch.equal(vd.augment_pixels(x, "none"), x)
    again = vd.augment_pixels(x, "shift", generator=torch.Generator().manual_seed(0))
    assert torch.equal(again, out)  # seeded: resumable
    with pytest.raises(ValueError, match="augment must be one of"):
        vd.augment_pixels(x, "rotate")


def test_shift_flip_mirrors_about_half_and_only_training_batches_are_augmented():
    x = torch.full((400, 1, 14, 14), -1.0)
    x[:, :, 2, 2] = 1.0  # a mark near the left edge: mirroring moves it to column 11
    out = vd.augment_pixels(x, "shift-flip", generator=torch.Generator().manual_seed(1))
    col = (out[:, 0] == 1.0).nonzero()[:, 2]
    assert col.shape == (400,) and set(col.tolist()) <= {1, 2, 3, 10, 11, 12}
    assert 0.4 < (col >= 10).float().mean() < 0.6
    images, labels = patterns(8, 12)
    data = vd.ImageData(images[:, None], labels, CLASSES, "x")
    plain = ImageCollate(data)(list(range(8)))["pixel_values"]
    torch.manual_seed(0)
    aug = ImageCollate(data, augment="shift")(list(range(8)))["pixel_values"]
    assert not torch.equal(aug, plain)
    with pytest.raises(ValueError, match="augment must be one of"):
        ImageCollate(data, augment="rotate")

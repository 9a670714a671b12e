"""Labelled images from an image folder, an ``.npz`` file, or the bundled FashionMNIST.

Everything is read with numpy (and Pillow for image files) into one in-memory array, so a
Poisson-sampled batch is a single fancy-indexing operation. Pixels are turned into model
inputs by :func:`to_pixels` with a *fixed* normalisation ((x - 0.5) / 0.5): statistics
computed from the private training set would themselves be a release that the privacy
accounting does not cover.

FashionMNIST comes from Debian's ``dataset-fashion-mnist`` package (the four idx files in
``/usr/share/datasets/fashion-mnist``); ``scripts/setup.sh`` installs it where apt-get is
available. Nothing is downloaded.
"""

from __future__ import annotations

import gzip
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dpfit.data.rowhash import (
    HELD_OUT,
    PUBLIC,
    SUBSAMPLE,
    held_out_mask,
    image_row,
    row_keys,
    smallest,
)
from dpfit.errors import DPFitError
from dpfit.vision.augment_names import AUGMENTS

FASHION_MNIST = "fashion-mnist"
FASHION_MNIST_DIRS = ("/usr/share/datasets/fashion-mnist",)
FASHION_MNIST_ENV = "DPFIT_FASHION_MNIST_DIR"
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm")
SPLITS = ("train", "test")
# The input geometry of a model for an image folder when neither a starting model nor
# --channels / --image-size fixes it. Never read from the images: a folder's files may differ
# in mode and size, and one colour or odd-sized image would otherwise decide the published
# architecture. Every image is converted and resized to it.
FOLDER_CHANNELS = 3
FOLDER_IMAGE_SIZE = 32
FOLDER_MODES = {1: "L", 3: "RGB"}


class ImageDataError(DPFitError, ValueError):
    """Image data could not be read or has the wrong shape; the message says what to fix."""


class DatasetNotInstalledError(ImageDataError, FileNotFoundError):
    """A bundled data set is not installed on this machine."""


@dataclass(frozen=True, eq=False)
class ImageData:
    """Images (N, C, H, W) as uint8 (0..255) or float32 (0..1), integer labels, class names.

    `names_from_data` says whether the class names were read from the data (folder names, an
    .npz's labels or label_names, the largest label of an idx file): such names say who is in
    the data when few examples carry them. Fixed names (FashionMNIST's, or names the caller
    mapped the labels onto) do not depend on the examples.
    """

    images: np.ndarray
    labels: np.ndarray
    label_names: tuple[str, ...]
    source: str
    notes: tuple[str, ...] = field(default=())
    names_from_data: bool = True

    def __post_init__(self) -> None:
        if self.images.ndim != 4:
            raise ImageDataError(
                f"{self.source}: images must be (N, C, H, W), got {self.images.shape}"
            )
        if len(self.images) != len(self.labels):
            raise ImageDataError(
                f"{self.source}: {len(self.images)} images but {len(self.labels)} labels"
            )
        if len(self.labels) and (
            self.labels.min() < 0 or self.labels.max() >= len(self.label_names)
        ):
            raise ImageDataError(
                f"{self.source}: labels must be in 0..{len(self.label_names) - 1}, got "
                f"{int(self.labels.min())}..{int(self.labels.max())}"
            )

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def channels(self) -> int:
        return int(self.images.shape[1])

    @property
    def size(self) -> tuple[int, int]:
        return int(self.images.shape[2]), int(self.images.shape[3])

    def subset(self, indices: Sequence[int] | np.ndarray, what: str) -> ImageData:
        idx = np.asarray(indices, dtype=np.int64)
        return ImageData(
            self.images[idx],
            self.labels[idx],
            self.label_names,
            f"{self.source} [{what}]",
            names_from_data=self.names_from_data,
        )

    def class_counts(self) -> dict[str, int]:
        """Examples per class name (0 for a name no example carries)."""
        counts = np.bincount(self.labels, minlength=len(self.label_names))
        return {n: int(c) for n, c in zip(self.label_names, counts, strict=True)}

    def row_keys(self, seed: int, purpose: str) -> np.ndarray:
        """Each image's key in [0, 1) from its pixels and class name (dpfit.data.rowhash)."""
        names = self.label_names
        rows = (image_row(x, names[y]) for x, y in zip(self.images, self.labels, strict=True))
        return row_keys(rows, seed, purpose)

    def split(
        self, fraction: float, seed: int, purpose: str = HELD_OUT
    ) -> tuple[ImageData, ImageData]:
        """(rest, held): an image is held out iff its own key is below `fraction` (public
        randomness, seeded), so one image added or removed changes each side by that image
        alone. `purpose` keeps independent splits (held-out test, public share) independent."""
        if not 0 < fraction < 1:
            raise ValueError(f"fraction must be in (0, 1), got {fraction}")
        held = held_out_mask(self.row_keys(seed, purpose), fraction)
        if held.all() or not held.any():
            raise ImageDataError(
                f"{self.source}: no image of {len(self)} fell on the "
                f"{'held' if not held.any() else 'remaining'} side of a {fraction:g} split "
                "(each image's side comes from a hash of it and the seed); use more images, "
                "another seed, or give the split's data separately"
            )
        pct = f"{100 * fraction:g}%"
        rest_idx, held_idx = np.flatnonzero(~held), np.flatnonzero(held)
        return self.subset(rest_idx, f"all but {pct} by row hash, seed {seed}"), self.subset(
            held_idx, f"{pct} by row hash, seed {seed}"
        )

    def subsample(self, n: int, seed: int, purpose: str = SUBSAMPLE) -> ImageData:
        """The `n` images with the smallest keys: one image added to the data changes this
        subset by at most one image in and one out."""
        if n >= len(self):
            return self
        idx = smallest(self.row_keys(seed, purpose), n)
        return self.subset(idx, f"random {n} by row hash, seed {seed}")


def public_private_split(
    data: ImageData, public_fraction: float, seed: int
) -> tuple[ImageData, ImageData]:
    """(public, private): the images whose own key is below `public_fraction` are public.

    The same (data, fraction, seed) always gives the same split, so ``dpfit pretrain`` and
    ``dpfit train`` agree on which examples are public without exchanging index lists; and an
    image is public or private by itself, whatever else the data holds.
    """
    private, public = data.split(public_fraction, seed, purpose=PUBLIC)
    return public, private


# -- pixels -> model input ------------------------------------------------------------------


def to_pixels(
    images: np.ndarray, channels: int | None = None, size: int | None = None
) -> torch.Tensor:
    """float32 (B, C, H, W) in [-1, 1]: fixed normalisation, channel repeat, bilinear resize."""
    x = torch.from_numpy(np.ascontiguousarray(images))
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float()
    x = (x - 0.5) / 0.5
    if channels is not None and x.shape[1] != channels:
        if x.shape[1] == 1:
            x = x.expand(-1, channels, -1, -1)
        else:
            raise ImageDataError(
                f"the model takes {channels}-channel images but the data has {x.shape[1]} "
                "channels; use a model built for this data (e.g. --model resnet-gn)"
            )
    if size is not None and tuple(x.shape[-2:]) != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    # Canonical NCHW strides. With one channel, elementwise ops leave a channel stride of 1,
    # which convolutions read as channels-last and answer with channels-last outputs; torch
    # 2.13's CPU GroupNorm backward on those crashes when only the bias needs a gradient.
    return torch.empty(x.shape, dtype=x.dtype).copy_(x)


# "shift" moves an image by up to SHIFT_FRACTION of its side (see dpfit.vision.augment_names).
SHIFT_FRACTION = 1 / 14  # 2 pixels at 28x28


def augment_pixels(x: torch.Tensor, kind: str, generator: torch.Generator | None = None):
    """A randomly shifted (and for "shift-flip" mirrored) copy of model inputs (B, C, H, W).

    Each image moves independently; uncovered pixels are black (-1 after the fixed
    normalisation). Randomness comes from `generator` (default: torch's global generator,
    which checkpoints save, so a resumed run draws the same augmentations)."""
    if kind not in AUGMENTS:
        raise ValueError(f"augment must be one of {AUGMENTS}, got {kind!r}")
    if kind == "none" or x.shape[0] == 0:
        return x
    b, _, h, w = x.shape
    pad = max(1, round(SHIFT_FRACTION * min(h, w)))
    padded = F.pad(x, (pad, pad, pad, pad), value=-1.0)
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    rows = (dy[:, None] + torch.arange(h))[:, :, None]  # (B, H, 1)
    cols = (dx[:, None] + torch.arange(w))[:, None, :]  # (B, 1, W)
    out = padded[torch.arange(b)[:, None, None], :, rows, cols]  # (B, H, W, C)
    out = out.permute(0, 3, 1, 2)
    if kind == "shift-flip":
        flip = torch.rand(b, generator=generator) < 0.5
        out = torch.where(flip[:, None, None, None], out.flip(-1), out)
    return torch.empty(out.shape, dtype=out.dtype).copy_(out)  # canonical NCHW (see to_pixels)


class ImageCollate:
    """Turns a list of example indices into ``{"pixel_values", "labels"}`` tensors.

    The privacy engine's loader hands the collate a list of dataset items; the dataset is
    ``range(len(data))``, so items are indices and a batch is one numpy gather. `augment`
    (training only) applies :func:`augment_pixels` to each batch.
    """

    def __init__(
        self,
        data: ImageData,
        channels: int | None = None,
        size: int | None = None,
        augment: str = "none",
    ):
        if augment not in AUGMENTS:
            raise ValueError(f"augment must be one of {AUGMENTS}, got {augment!r}")
        self.data = data
        self.channels = channels
        self.size = size
        self.augment = augment

    def __call__(self, items: list[int]) -> dict[str, torch.Tensor]:
        idx = np.asarray(items, dtype=np.int64)
        pixels = to_pixels(self.data.images[idx], self.channels, self.size)
        return {
            "pixel_values": augment_pixels(pixels, self.augment),
            "labels": torch.from_numpy(self.data.labels[idx].astype(np.int64)),
        }


# -- readers ---------------------------------------------------------------------------------


def load_images(
    spec: str | os.PathLike | None,
    split: str = "train",
    label_names: Sequence[str] | None = None,
    image_size: int | None = None,
    channels: int | None = None,
) -> ImageData:
    """Read labelled images.

    Args:
        spec: None or ``"fashion-mnist"`` (bundled; `split` picks train or test), an ``.npz``
            file (arrays ``images`` (N, H, W) or (N, C, H, W) and ``labels``; optional
            ``label_names``), a folder of idx files, or an ImageFolder-layout folder
            (``DIR/<class name>/<image files>``).
        label_names: the classes of a model being evaluated or fine-tuned; labels are mapped
            to these (an unknown class is an error).
        image_size, channels: ImageFolder only: every image is converted to `channels` (1:
            greyscale, 3: RGB) and resized to this square size; defaults FOLDER_CHANNELS and
            FOLDER_IMAGE_SIZE, never the images' own (the architecture is published). An
            .npz or idx file has one shape for all its examples: it is kept.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if spec is None or str(spec) == FASHION_MNIST:
        data = load_fashion_mnist(split)
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ImageDataError(
                f"{spec}: no such file or folder; pass an ImageFolder-layout folder, an .npz "
                f"file, or {FASHION_MNIST!r}"
            )
        if path.is_file() and path.suffix == ".npz":
            data = load_npz(path)
        elif path.is_dir() and _idx_files(path, split) is not None:
            data = load_idx_folder(path, split, FASHION_MNIST_CLASSES, str(path))
        elif path.is_dir():
            data = load_image_folder(path, image_size, channels)
        else:
            raise ImageDataError(
                f"{spec}: not an .npz file or a folder; image data must be an ImageFolder-layout "
                "folder (DIR/<class>/<images>), an .npz with arrays images and labels, or a "
                "folder with idx files"
            )
    return data if label_names is None else relabel(data, label_names)


def relabel(data: ImageData, label_names: Sequence[str]) -> ImageData:
    """Map `data`'s labels onto `label_names` (a model's classes), by name."""
    names = tuple(str(n) for n in label_names)
    if tuple(data.label_names) == names:
        return data
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted(set(data.label_names) - set(index))
    if unknown:
        raise ImageDataError(
            f"{data.source} has classes {unknown[:5]} the model does not know ({list(names)[:10]})"
        )
    mapping = np.array([index[n] for n in data.label_names], dtype=np.int64)
    return ImageData(data.images, mapping[data.labels], names, data.source, names_from_data=False)


def fashion_mnist_dir() -> Path | None:
    candidates = [os.environ.get(FASHION_MNIST_ENV, ""), *FASHION_MNIST_DIRS]
    for c in candidates:
        if c and _idx_files(Path(c), "train") is not None:
            return Path(c)
    return None


def load_fashion_mnist(split: str = "train") -> ImageData:
    folder = fashion_mnist_dir()
    if folder is None:
        raise DatasetNotInstalledError(
            "FashionMNIST is not installed: no idx files in "
            f"{', '.join(FASHION_MNIST_DIRS)} (or ${FASHION_MNIST_ENV}). Install it with "
            "`sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu; scripts/setup.sh does "
            "this), or put train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "
            "t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz in a folder and set "
            f"{FASHION_MNIST_ENV} to it, or pass --data with your own images"
        )
    return load_idx_folder(folder, split, FASHION_MNIST_CLASSES, f"{FASHION_MNIST} {split}")


def _idx_files(folder: Path, split: str) -> tuple[Path, Path] | None:
    prefix = "train" if split == "train" else "t10k"
    found = []
    for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"):
        for suffix in ("", ".gz"):
            p = folder / f"{prefix}-{kind}{suffix}"
            if p.is_file():
                found.append(p)
                break
    return (found[0], found[1]) if len(found) == 2 else None


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An idx file (the MNIST format: big-endian header, then raw data), gzipped or not."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ImageDataError(f"{path} is not an idx file (bad magic number)")
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if raw[2] not in dtypes:
        raise ImageDataError(f"{path}: unknown idx data type 0x{raw[2]:02x}")
    ndim = raw[3]
    if len(raw) < 4 + 4 * ndim:
        raise ImageDataError(f"{path}: header truncated")
    dims = np.frombuffer(raw, dtype=">u4", count=ndim, offset=4).astype(np.int64)
    dtype = np.dtype(dtypes[raw[2]])
    body = 4 + 4 * ndim
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(raw) - body != expected:
        raise ImageDataError(
            f"{path}: header says {tuple(dims)} ({expected} bytes) but {len(raw) - body} follow; "
            "the file is truncated or corrupt"
        )
    return (
        np.frombuffer(raw, dtype=dtype, offset=body)
        .reshape(tuple(dims))
        .astype(dtype.newbyteorder("="))
    )


def load_idx_folder(folder: Path, split: str, label_names: Sequence[str], source: str) -> ImageData:
    files = _idx_files(folder, split)
    if files is None:
        raise ImageDataError(f"{folder}: no {split} idx files")
    images, labels = read_idx(files[0]), read_idx(files[1]).astype(np.int64)
    if images.ndim == 3:
        images = images[:, None]
    names, from_data = tuple(label_names), False
    if labels.size and labels.max() >= len(names):  # more classes than the fixed names
        names, from_data = tuple(str(i) for i in range(int(labels.max()) + 1)), True
    return ImageData(images, labels, names, source, names_from_data=from_data)


def load_npz(path: Path) -> ImageData:
    with np.load(path, allow_pickle=False) as z:
        missing = [k for k in ("images", "labels") if k not in z.files]
        if missing:
            raise ImageDataError(
                f"{path} lacks arrays {missing} (has {z.files}); save it with "
                "np.savez(path, images=..., labels=...)"
            )
        images, labels = z["images"], z["labels"]
        given_names = tuple(str(n) for n in z["label_names"]) if "label_names" in z.files else None
    if images.ndim == 3:
        images = images[:, None]
    if images.ndim != 4 or images.shape[1] not in (1, 2, 3, 4):
        hint = (
            " (channels last? use images.transpose(0, 3, 1, 2))"
            if images.ndim == 4 and images.shape[-1] in (1, 3, 4)
            else ""
        )
        raise ImageDataError(
            f"{path}: images must have shape (N, H, W) or (N, C, H, W) with C <= 4, got "
            f"{images.shape}{hint}"
        )
    if images.dtype != np.uint8:
        images = images.astype(np.float32)
        lo, hi = float(images.min(initial=0)), float(images.max(initial=0))
        if lo < 0 or hi > 1:
            raise ImageDataError(
                f"{path}: float images must lie in [0, 1] (got {lo:g}..{hi:g}); "
                "store uint8 (0..255) or scale them"
            )
    if labels.ndim != 1:
        raise ImageDataError(f"{path}: labels must be one-dimensional, got {labels.shape}")
    if labels.dtype.kind in "iu":
        names = given_names or tuple(str(i) for i in range(int(labels.max(initial=-1)) + 1))
        labels = labels.astype(np.int64)
    else:
        strings = labels.astype(str)
        names = given_names or tuple(sorted(set(strings.tolist())))
        index = {n: i for i, n in enumerate(names)}
        labels = np.array([index[s] for s in strings.tolist()], dtype=np.int64)
    return ImageData(images, labels, names, str(path))


def load_image_folder(
    folder: Path, image_size: int | None = None, channels: int | None = None
) -> ImageData:
    """Every image converted to `channels` and resized to `image_size` (square), values that
    come from public inputs only (see FOLDER_CHANNELS)."""
    channels = FOLDER_CHANNELS if channels is None else channels
    if channels not in FOLDER_MODES:
        raise ImageDataError(
            f"{folder}: images of a folder are read as 1 (greyscale) or 3 (RGB) channels, "
            f"got --channels {channels}"
        )
    side = FOLDER_IMAGE_SIZE if image_size is None else image_size
    try:
        from PIL import Image
    except ImportError as e:  # pragma: no cover - Pillow ships with matplotlib
        raise ImageDataError(
            "reading an image folder needs Pillow: pip install 'dpfit[vision]'"
        ) from e
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    files = [
        (f, c)
        for c, name in enumerate(classes)
        for f in sorted((folder / name).iterdir())
        if f.suffix.lower() in IMAGE_SUFFIXES
    ]
    if not files:
        raise ImageDataError(
            f"{folder}: no images found; the ImageFolder layout is DIR/<class name>/<image "
            f"files> with suffixes {', '.join(IMAGE_SUFFIXES)}"
        )
    pics = [Image.open(f) for f, _ in files]
    mode = FOLDER_MODES[channels]
    size = (side, side)
    arrays = []
    for p in pics:
        p = p.convert(mode)
        if p.size != size:
            p = p.resize(size, Image.BILINEAR)
        a = np.asarray(p, dtype=np.uint8)
        arrays.append(a[None] if a.ndim == 2 else a.transpose(2, 0, 1))
    images = np.stack(arrays)
    labels = np.array([c for _, c in files], dtype=np.int64)
    return ImageData(images, labels, tuple(classes), str(folder))

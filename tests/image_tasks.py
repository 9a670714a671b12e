"""Small generated image tasks: never the real data set, never a download."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

CLASSES = ("flat", "horizontal", "vertical", "checker")


def patterns(n: int, size: int = 12, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 (n, size, size), labels): one texture per class plus pixel noise."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, n)
    r, c = np.mgrid[:size, :size]
    textures = np.stack(
        [np.zeros((size, size)), (r // 2) % 2, (c // 2) % 2, ((r // 2) + (c // 2)) % 2]
    ).astype(np.float32)
    amp = rng.uniform(0.4, 0.8, (n, 1, 1))
    base = rng.uniform(0.1, 0.3, (n, 1, 1))
    x = base + amp * textures[labels] + rng.normal(0, 0.1, (n, size, size))
    return (np.clip(x, 0, 1) * 255).astype(np.uint8), labels.astype(np.int64)


def write_npz(path: Path, n: int, size: int = 12, seed: int = 0) -> Path:
    images, labels = patterns(n, size, seed)
    np.savez(path, images=images, labels=labels, label_names=np.array(CLASSES))
    return path


def write_idx(path: Path, array: np.ndarray, code: int = 0x08) -> None:
    """A gzipped idx file (the MNIST format) holding `array`."""
    header = struct.pack(">BBBB", 0, 0, code, array.ndim) + struct.pack(
        f">{array.ndim}I", *array.shape
    )
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(">u1").tobytes())

"""Image splits keep neighbours neighbours: one image added to or removed from the data
changes the held-out test, the public/private split and what trains by exactly that image
(by at most one swap under --max-train-examples)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from dpfit.data.rowhash import SPLIT_RULE
from dpfit.errors import DPFitError
from dpfit.tasks.image_classification import ImageOptions, prepare_images
from dpfit.train import TrainConfig
from dpfit.vision.data import ImageData, public_private_split

NAMES = ("a", "b", "c")


def images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 1, 6, 6), dtype=np.uint8), rng.integers(0, 3, n)


def bag(d: ImageData) -> Counter:
    return Counter((x.tobytes(), d.label_names[y]) for x, y in zip(d.images, d.labels, strict=True))


def neighbours(n: int = 1000, at: int = 400) -> tuple[ImageData, ImageData, ImageData]:
    x, y = images(n)
    extra_x, extra_y = images(1, seed=99)
    ax = np.concatenate([x[:at], extra_x, x[at:]])
    ay = np.concatenate([y[:at], extra_y, y[at:]])
    keep = np.arange(n) != n // 2
    return (
        ImageData(x, y, NAMES, "base"),
        ImageData(ax, ay, NAMES, "added"),
        ImageData(x[keep], y[keep], NAMES, "removed"),
    )


def moved(a: tuple[ImageData, ImageData], b: tuple[ImageData, ImageData]) -> int:
    """Images on a different side in b than in a, or in only one of them."""
    return sum(((bag(b[0]) - bag(a[0])) + (bag(a[0]) - bag(b[0]))).values()) + sum(
        ((bag(b[1]) - bag(a[1])) + (bag(a[1]) - bag(b[1]))).values()
    )


@pytest.mark.parametrize("how", ["held-out", "public"])
def test_split_adding_or_removing_an_image_moves_only_that_image(how):
    base, added, removed = neighbours()

    def split(d: ImageData):
        return d.split(0.1, seed=3) if how == "held-out" else public_private_split(d, 0.1, 3)

    s = split(base)
    assert moved(s, split(added)) == 1 and moved(s, split(removed)) == 1
    assert split(base)[1].images.tobytes() == s[1].images.tobytes()  # seeded
    assert abs(len(s[1 if how == "held-out" else 0]) / len(base) - 0.1) < 0.03


def test_held_out_and_public_shares_are_independent():
    base, _, _ = neighbours()
    rest, _ = base.split(0.1, seed=0)
    public, private = public_private_split(rest, 0.1, seed=0)
    assert len(public) > 0 and len(private) > 0  # not the same keys below the same fraction


def test_subsample_changes_by_at_most_one_swap():
    base, added, removed = neighbours()
    for other in (added, removed):
        a, b = bag(base.subsample(500, seed=1)), bag(other.subsample(500, seed=1))
        assert sum((a - b).values()) <= 1 and sum((b - a).values()) <= 1


def test_prepare_images_from_a_file_is_neighbour_stable(tmp_path):
    base, added, _ = neighbours(600)
    files = []
    for d in (base, added):
        files.append(tmp_path / f"{d.source}.npz")
        np.savez(files[-1], images=d.images, labels=d.labels, label_names=np.array(NAMES))
    opts = ImageOptions(public_fraction=0.2)

    def prep(f, **kw):
        return prepare_images(TrainConfig(task="image-classification", data=str(f),
                                          public_labels=True, **kw), opts)  # fmt: skip

    pa, pb = prep(files[0]), prep(files[1])
    assert moved((pa.train, pa.test), (pb.train, pb.test)) <= 1  # public side: maybe the one
    assert sum((bag(pa.train) - bag(pb.train)).values()) == 0
    assert pa.split["split_rule"] == SPLIT_RULE and pa.public_split["rule"] == SPLIT_RULE
    sa, sb = prep(files[0], max_train_examples=200), prep(files[1], max_train_examples=200)
    assert sum((bag(sa.train) - bag(sb.train)).values()) <= 1
    assert "epsilon_replace_one" in sa.split["file_neighbouring"]


def test_pretrained_record_of_an_older_split_rule_is_refused(tmp_path):
    base, _, _ = neighbours(200)
    f = tmp_path / "d.npz"
    np.savez(f, images=base.images, labels=base.labels, label_names=np.array(NAMES))
    cfg = TrainConfig(task="image-classification", data=str(f), public_labels=True)
    old = {"source": str(f), "fraction": 0.2, "seed": 0, "n_public": 40}
    with pytest.raises(DPFitError, match="earlier split rule"):
        prepare_images(cfg, ImageOptions(), recorded_split=old)
    new = prepare_images(cfg, ImageOptions(public_fraction=0.2, split="public"))
    rec = new.public_split
    got = prepare_images(dataclasses.replace(cfg), ImageOptions(), recorded_split=rec)
    assert not set(bag(got.train)) & set(bag(new.train))  # no public image trains privately

"""Image classification as a task plug-in: labelled images, a factory model, cross-entropy,
accuracy.

It runs through the one training loop (:func:`dpfit.train.train`), so private fine-tuning
(DP-BiTFiT, DP full, DP last layer, two-phase X+BiTFiT), non-private public pretraining
(``dpfit pretrain``), checkpoints and resumption, and the outputs are those of every task.
What is the image task's own: reading the images, the public/private split, the model
factory, the loss and the metric, and saving the model with its pretraining record.

The public/private split is a seeded fraction of the training data, each image's side from a
keyed hash of the image (:func:`dpfit.vision.data.public_private_split`). Pretraining records it in the saved model;
private fine-tuning of that model on the same data reuses it and refuses a split that would
put examples the model has already seen non-privately into the "private" set.

Class names are published (the saved model, metrics.json): names read from the user's data
(ImageFolder folders, an .npz's labels) pass the same rare-label rule as text classification
(:mod:`dpfit.tasks.labels`) unless the user gives them (``--labels``) or declares them public;
FashionMNIST's names ship with the data set and are public.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dpfit.data.rowhash import (
    EVAL_SUBSAMPLE,
    FIXED_SIZE_NOTE,
    FIXED_SIZE_RECORD,
    SPLIT_RULE,
    small_test_note,
)
from dpfit.errors import DPFitError
from dpfit.tasks.base import Prepared
from dpfit.tasks.labels import check_data_label_names
from dpfit.vision.data import (
    AUGMENTS,
    FASHION_MNIST,
    ImageCollate,
    ImageData,
    load_images,
    public_private_split,
    relabel,
)
from dpfit.vision.models import (
    SPEC_FILE,
    ImageModel,
    load_image_model,
    read_record,
    save_image_model,
)

logger = logging.getLogger(__name__)

NAME = "image-classification"
DEFAULT_MODEL = "resnet-gn"
SPLITS = ("private", "public")
HELD_OUT = 0.1  # test share held out of a user's data set when no --eval-data is given


@dataclass(frozen=True)
class ImageOptions:
    """The image task's own settings (``TrainConfig.task_options``); part of the run's
    fingerprint, so a resumed run must use the same."""

    split: str = "private"  # which side of the public/private split to train on
    public_fraction: float | None = None  # None: as recorded by the pretrained model, else 0
    split_seed: int | None = None  # seeds the public/private split and the held-out test
    # share; None: as recorded by the pretrained model, else 0
    # the input geometry of a new model, from public inputs only: square
    # size and channels; None: the starting model's, else the file's (.npz, idx) or, for an
    # image folder, FOLDER_IMAGE_SIZE / FOLDER_CHANNELS. Never read from individual images.
    image_size: int | None = None
    channels: int | None = None
    max_eval_examples: int | None = None
    replace_batchnorm: bool = False  # a user model's BatchNorm -> GroupNorm
    head_only: bool = False  # DP last layer: the head alone trains
    augment: str = "none"  # training batches only: none | shift | shift-flip (vision.data)

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if self.public_fraction is not None and not 0 <= self.public_fraction < 1:
            raise ValueError(f"public_fraction must be in [0, 1), got {self.public_fraction}")
        if self.image_size is not None and self.image_size < 4:
            raise ValueError(f"image_size must be >= 4, got {self.image_size}")
        if self.channels is not None and self.channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {self.channels}")
        if self.augment not in AUGMENTS:
            raise ValueError(f"augment must be one of {AUGMENTS}, got {self.augment!r}")
        if self.max_eval_examples is not None and self.max_eval_examples < 1:
            raise ValueError(f"max_eval_examples must be >= 1, got {self.max_eval_examples}")


def options_of(config) -> ImageOptions:
    opts = getattr(config, "task_options", None)
    if opts is None:
        return ImageOptions()
    if not isinstance(opts, ImageOptions):
        raise DPFitError(f"task_options of an image run must be ImageOptions, got {type(opts)}")
    return opts


def check(config, opts: ImageOptions) -> None:
    """Combinations that cannot run, found before any image is read."""
    if config.add_biases:
        raise DPFitError("--add-biases is for text models; the image models here have biases")
    if opts.split == "public" and not config.non_private:
        raise DPFitError("training on the public split is non-private (dpfit pretrain)")
    if opts.head_only and (config.mode != "bias" or config.full_epochs):
        raise DPFitError("--head-only trains the head alone; drop --mode full / --full-epochs")


# -- data ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedImages:
    train: ImageData
    test: ImageData
    public_split: dict | None  # {"source", "fraction", "seed", "n_public"} when one was made
    notes: tuple[str, ...]
    label_source: str = "bundled"  # why the class names may be published
    split: dict = field(default_factory=dict)  # the row-hash rule and fractions, for metrics


def _is_bundled(spec: str | None) -> bool:
    return spec is None or spec == FASHION_MNIST


def input_geometry(model_name: str, opts: ImageOptions) -> tuple[int | None, int | None]:
    """(channels, image size) of the model's input, from public inputs only: a starting
    model's own (the data is converted to it), else the flags; None where neither fixes it."""
    path = Path(str(model_name)).expanduser()
    spec_file, hf_config = path / SPEC_FILE, path / "config.json"
    if path.is_dir() and spec_file.is_file():
        spec = json.loads(spec_file.read_text())
        return int(spec["in_channels"]), int(spec["image_size"])
    if path.is_dir() and hf_config.is_file():
        cfg = json.loads(hf_config.read_text())
        size = cfg.get("image_size")
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = cfg.get("num_channels")
        return (
            None if channels is None else int(channels),
            None if size is None else int(size),
        )
    return opts.channels, opts.image_size


def prepare_images(
    config,
    opts: ImageOptions | None = None,
    recorded_split: dict | None = None,
    geometry: tuple[int | None, int | None] | None = None,
) -> PreparedImages:
    """Training and test images; the public/private split made (or inherited) and checked.

    `config` is a :class:`dpfit.train.TrainConfig` (data, eval_data, max_train_examples,
    seed); `recorded_split` is the pretrained model's record of its public split;
    `geometry` the (channels, size) an image folder is converted to (:func:`input_geometry`).
    """
    opts = opts or options_of(config)
    channels, size = geometry or (opts.channels, opts.image_size)
    notes: list[str] = []
    source = FASHION_MNIST if _is_bundled(config.data) else str(config.data)
    fraction, seed = opts.public_fraction, opts.split_seed
    private_side = opts.split == "private"
    same_source = bool(recorded_split) and recorded_split.get("source") == source
    if same_source and "seed" not in recorded_split and private_side:
        raise DPFitError(
            f"the model was pretrained non-privately on all of {source}; private fine-tuning "
            "on the same data protects nothing. Pretrain on a public share "
            "(--public-fraction) or on separate public data"
        )
    if same_source and "seed" in recorded_split and private_side:
        if recorded_split.get("rule") != SPLIT_RULE:
            raise DPFitError(
                f"the model was pretrained non-privately on a public share of {source} chosen "
                f"by an earlier split rule (a seeded permutation of the images); this dpfit "
                f"chooses each image's side by a hash of the image ({SPLIT_RULE}), so its "
                "private side would include images the model has seen. Pretrain again with "
                "this version (dpfit pretrain), or fine-tune on other data"
            )
    if same_source and "seed" in recorded_split:
        rec = (float(recorded_split["fraction"]), int(recorded_split["seed"]))
        if private_side and (fraction, seed) not in ((None, None), (None, rec[1]), rec):
            raise DPFitError(
                f"the model was pretrained non-privately on a public {rec[0]:g} of {source} "
                f"(split seed {rec[1]}); a private split with fraction "
                f"{rec[0] if fraction is None else fraction:g} and seed "
                f"{0 if seed is None else seed} would include some of those examples. Use "
                f"--public-fraction {rec[0]:g} --split-seed {rec[1]} (or leave both out)"
            )
        if private_side and fraction is None:
            fraction, seed = rec
            notes.append(
                f"public split from the pretrained model's record: {rec[0]:g} of {source} "
                f"(seed {rec[1]}) is public and excluded from private training"
            )
    seed = 0 if seed is None else seed
    data = load_images(config.data, "train", config.labels, image_size=size, channels=channels)
    all_public = not private_side and not fraction
    label_note_at = len(notes)  # the gate counts the images that train: after every split
    if config.eval_data is not None:
        split = "test" if _is_bundled(config.eval_data) else "train"
        test = load_images(
            config.eval_data, split, data.label_names, image_size=size, channels=channels
        )
    elif _is_bundled(config.data):
        test = load_images(None, "test")
    else:
        data, test = data.split(HELD_OUT, seed=seed)
        notes.append(
            f"no --eval-data: holding out the images of {config.data} whose keyed hash "
            f"(split seed {seed}) falls below {HELD_OUT:g}, about {HELD_OUT:.0%}, as the test "
            f"set ({len(test)} images)"
        )
    public_split = None
    if fraction:
        public, private = public_private_split(data, fraction, seed)
        public_split = {
            "source": source,
            "fraction": fraction,
            "seed": seed,
            "rule": SPLIT_RULE,
            "n_public": len(public),
            "n_private": len(private),
        }
        data = private if private_side else public
        notes.append(
            f"{opts.split} split: {len(data)} of {len(public) + len(private)} training images "
            f"({fraction:g} public, split seed {seed})"
        )
    elif not private_side:
        notes.append(f"all of {source} is treated as public (no --public-fraction)")
        public_split = {"source": source, "fraction": 1.0}
    split: dict = {}
    if config.eval_data is None and not _is_bundled(config.data):
        split["held_out_fraction"] = HELD_OUT
    if fraction:
        split["public_fraction"] = fraction
    if config.max_train_examples is not None and config.max_train_examples < len(data):
        notes.append(
            f"training on the {config.max_train_examples} of {len(data)} images with the "
            f"smallest keyed hash; {FIXED_SIZE_NOTE}"
        )
        data = data.subsample(config.max_train_examples, seed=config.seed)
        split["file_neighbouring"] = FIXED_SIZE_RECORD
    if opts.max_eval_examples is not None and opts.max_eval_examples < len(test):
        notes.append(f"evaluating on a random {opts.max_eval_examples} of {len(test)} images")
        test = test.subsample(opts.max_eval_examples, seed=config.seed, purpose=EVAL_SUBSAMPLE)
    small = small_test_note(len(test))
    if small is not None:
        notes.append(small)
    label_source, note = _label_names(data, config, source, all_public)
    notes.insert(label_note_at, note)
    if split:
        split = {"split_rule": SPLIT_RULE, **split}
    return PreparedImages(data, test, public_split, tuple(notes), label_source, split)


def _fresh_model_note(name: str, given: str | None) -> list[str]:
    """A factory name builds an untrained network: say so, or a run looks like fine-tuning."""
    from dpfit.vision.models import model_names

    if str(name) not in model_names():
        return []
    how = "" if given else " (no --model)"
    return [
        f"model: {name}{how}, randomly initialised, no pretrained weights; to start from "
        "trained features pass --model a `dpfit pretrain` output or another saved model"
    ]


PUBLISHED_IN = "the saved model (dpfit-vision.json) and metrics.json"


def _label_names(data: ImageData, config, source: str, all_public: bool) -> tuple[str, str]:
    """(source, note) of the class names this run publishes; refuses rare names read from
    the data. `data` is what trains (after the hold-out, the public/private split and
    --max-train-examples): images left out do not make a name common among those the
    model learns from."""
    names = ", ".join(data.label_names)
    if config.labels is not None:
        return "--labels", f"label names (public, from --labels): {names}"
    if not data.names_from_data:
        return "bundled", f"label names: fixed by the data set, not read from it (public): {names}"
    if all_public:  # pretraining on a data set declared public as a whole
        return "public data", f"label names of {source}, public with the data: {names}"
    note = check_data_label_names(
        data.label_names, data.class_counts(), source, config.public_labels, PUBLISHED_IN
    )
    return (
        "--public-labels" if config.public_labels else "training data (each name frequent)"
    ), note


# -- the metric ------------------------------------------------------------------------------


@torch.no_grad()
def predict_images(
    model: ImageModel, data: ImageData, batch_size: int = 256, device: str | torch.device = "cpu"
) -> np.ndarray:
    """The class index `model` predicts for each image of `data`, in data order, against the
    model's classes (relabel `data` first): two models compared image by image."""
    collate = ImageCollate(data, model.spec.in_channels, model.spec.image_size)
    module = model.module
    was_training = module.training
    module.eval()
    preds = []
    for start in range(0, len(data), batch_size):
        b = collate(list(range(start, min(start + batch_size, len(data)))))
        preds.append(module(b["pixel_values"].to(device)).argmax(-1).cpu())
    module.train(was_training)
    return torch.cat(preds).numpy() if preds else np.zeros(0, dtype=np.int64)


def evaluate_images(
    model: ImageModel, data: ImageData, batch_size: int = 256, device: str | torch.device = "cpu"
) -> dict:
    """Accuracy and per-class counts of `model` on `data` (relabelled to the model's classes)."""
    data = relabel(data, model.spec.label_names)
    pred = predict_images(model, data, batch_size, device)
    names = model.spec.label_names
    per_class = {}
    for c, name in enumerate(names):
        mask = data.labels == c
        per_class[name] = {
            "n": int(mask.sum()),
            "correct": int((pred[mask] == c).sum()),
            "predicted": int((pred == c).sum()),
        }
    correct = int((pred == data.labels).sum())
    return {
        "accuracy": correct / len(data) if len(data) else float("nan"),
        "n": len(data),
        "per_class": per_class,
    }


# -- the plug-in -----------------------------------------------------------------------------


def _trains(config, opts: ImageOptions) -> str:
    if opts.head_only:
        return "head"
    if config.full_epochs:
        return f"{config.full_epochs}+bias"
    return config.mode


class ImageClassificationTask:
    """Images -> factory model (its own linear head) -> cross-entropy; accuracy."""

    name = NAME

    def prepare(self, config) -> Prepared:
        opts = options_of(config)
        check(config, opts)
        model_name = config.model or DEFAULT_MODEL
        geometry = input_geometry(model_name, opts)
        data = prepare_images(config, opts, read_record(model_name).get("pretrained_on"), geometry)
        # a new model's input: the flags, else the data as converted (an image folder) or as
        # stored (one shape for a whole .npz / idx file), never one image's
        loaded = load_image_model(
            model_name,
            label_names=data.train.label_names,
            in_channels=geometry[0] or data.train.channels,
            image_size=geometry[1] or max(data.train.size),
            seed=config.seed,
            replace_batchnorm=opts.replace_batchnorm,
        )
        if opts.head_only and not loaded.head_names:
            raise DPFitError(f"{loaded.source}: no head module to train (--head-only)")
        train = relabel(data.train, loaded.spec.label_names)
        return Prepared(
            model=loaded.module,
            tokenizer=None,
            n=len(train),
            num_classes=loaded.spec.num_classes,
            head_names=loaded.head_names,
            notes=[*data.notes, *_fresh_model_note(model_name, config.model)],
            state={
                "image_model": loaded,
                "data": data,
                "train": train,
                "options": opts,
                "private": not config.non_private,
            },  # fmt: skip
            head_only=opts.head_only,
            starts_trained=loaded.head_trained,
        )

    def items(self, prep: Prepared, max_length: int) -> range:
        # the examples are indices into one in-memory array; ImageCollate gathers a batch
        return range(prep.n)

    def collate(self, prep: Prepared, position_ids: bool) -> Callable[[list], dict]:
        spec = prep.state["image_model"].spec
        augment = prep.state["options"].augment
        return ImageCollate(prep.state["train"], spec.in_channels, spec.image_size, augment)

    def loss(self, model, batch: dict) -> torch.Tensor:
        return F.cross_entropy(model(batch["pixel_values"]), batch["labels"])

    def evaluate(self, prep: Prepared, model, config, device) -> dict:
        image_model: ImageModel = prep.state["image_model"]
        data: PreparedImages = prep.state["data"]
        res = evaluate_images(image_model, data.test, config.eval_batch_size, device)
        return {
            "accuracy": res["accuracy"],
            "eval_n": res["n"],
            "per_class": res["per_class"],
            "eval_source": data.test.source,
            "train_source": data.train.source,
            "train_examples": prep.n,
            "trains": _trains(config, prep.state["options"]),
            "model": image_model.spec.arch,
            "image_size": image_model.spec.image_size,
            "public_split": data.public_split,
            **data.split,
            "label_names_public": True,
            "label_names_source": data.label_source,
        }

    def save(self, prep: Prepared, model, folder: Path) -> None:
        """The model with its spec and pretraining record (dpfit.json, written next to it by
        the loop, holds the privacy record)."""
        image_model: ImageModel = prep.state["image_model"]
        data: PreparedImages = prep.state["data"]
        record: dict = {"private": prep.state["private"]}
        previous = image_model.extra.get("dpfit", {})
        if prep.state["options"].split == "public":
            record["pretrained_on"] = data.public_split or {"source": data.train.source}
        elif previous.get("pretrained_on"):
            record["pretrained_on"] = previous["pretrained_on"]
        save_image_model(image_model, folder, record)

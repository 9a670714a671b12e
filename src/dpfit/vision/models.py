"""Image classifiers without BatchNorm, built by name, saved and loaded as one folder.

Every model here maps ``pixel_values`` (B, C, H, W) to logits (B, classes), so the training
loop, the evaluator and the privacy engine treat them alike. Names in the factory:

* ``resnet-gn``: a small ResNet (basic blocks, three stages) with GroupNorm in place of
  BatchNorm, whose batch statistics mix examples and make per-example gradients undefined;
* ``vit-tiny``: a small Vision Transformer from transformers' ``ViTConfig`` /
  ``ViTForImageClassification``. transformers is already a dependency and maintained;
  torchvision's wheel does not match the pinned torch here and timm depends on torchvision.

``--model`` may also be a folder written by :func:`save_image_model` (``dpfit pretrain`` /
``dpfit train`` output ``DIR/model``), a transformers image-classification folder, or a torch
file holding a whole ``nn.Module`` (unpickled: load only files you trust). BatchNorm in a
user's model is refused by the engine unless ``replace_batchnorm`` turns it into GroupNorm.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dpfit.errors import DPFitError

logger = logging.getLogger(__name__)

SPEC_FILE = "dpfit-vision.json"
WEIGHTS_FILE = "model.safetensors"
MODULE_FILE = "module.pt"
PRIVACY_FILE = "dpfit.json"
FORMAT_VERSION = 1


class ImageModelError(DPFitError, ValueError):
    """An image model name, folder or file cannot be used; the message says what to pass."""


@dataclass(frozen=True)
class ImageModelSpec:
    """What is needed to rebuild a model: architecture, input and output shape, options."""

    arch: str
    num_classes: int
    in_channels: int
    image_size: int
    label_names: tuple[str, ...]
    options: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"format": FORMAT_VERSION, **asdict(self), "label_names": list(self.label_names)}

    @classmethod
    def from_dict(cls, d: dict) -> ImageModelSpec:
        return cls(
            arch=d["arch"],
            num_classes=int(d["num_classes"]),
            in_channels=int(d["in_channels"]),
            image_size=int(d["image_size"]),
            label_names=tuple(d["label_names"]),
            options=dict(d.get("options", {})),
        )


@dataclass
class ImageModel:
    """A model, its spec, and the names of its head modules (trained next to the biases)."""

    module: nn.Module
    spec: ImageModelSpec
    head_names: tuple[str, ...]
    source: str
    extra: dict = field(default_factory=dict)  # e.g. the record of a pretraining run
    # the head was trained with the rest (a saved model, same classes); False for a factory
    # build or a fresh head for new classes
    head_trained: bool = True


Builder = Callable[[ImageModelSpec], tuple[nn.Module, tuple[str, ...]]]
_FACTORY: dict[str, Builder] = {}


def register_model(name: str) -> Callable[[Builder], Builder]:
    def deco(fn: Builder) -> Builder:
        _FACTORY[name] = fn
        return fn

    return deco


def model_names() -> list[str]:
    return sorted(_FACTORY)


# -- resnet-gn -------------------------------------------------------------------------------


def _groups(channels: int, max_groups: int = 8) -> int:
    return math.gcd(channels, max_groups)


class BasicBlock(nn.Module):
    """conv-GN-ReLU-conv-GN plus a (projected) shortcut, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.norm1 = nn.GroupNorm(_groups(cout), cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.norm2 = nn.GroupNorm(_groups(cout), cout)
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(_groups(cout), cout)
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetGN(nn.Module):
    """Stem, three stages of basic blocks (width w, 2w, 4w; stride 1, 2, 2), pool, linear."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 16, blocks=(1, 1, 1)):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
            nn.GroupNorm(_groups(width), width),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        cin = width
        for stage, n in enumerate(blocks):
            cout = width * 2**stage
            for b in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (stage > 0 and b == 0) else 1))
                cin = cout
        self.stages = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(pixel_values))
        return self.fc(self.pool(x).flatten(1))


@register_model("resnet-gn")
def build_resnet_gn(spec: ImageModelSpec) -> tuple[nn.Module, tuple[str, ...]]:
    o = spec.options
    model = ResNetGN(
        spec.in_channels,
        spec.num_classes,
        width=int(o.get("width", 16)),
        blocks=tuple(o.get("blocks", (1, 1, 1))),
    )
    return model, ("fc",)


# -- vit-tiny (transformers) -----------------------------------------------------------------


class HFImageClassifier(nn.Module):
    """A transformers image classifier with the factory's ``pixel_values -> logits`` call."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.net(pixel_values=pixel_values).logits


VIT_TINY = dict(hidden_size=96, num_hidden_layers=4, num_attention_heads=3, intermediate_size=192)


def _patch_size(image_size: int) -> int:
    for p in (7, 4, 8, 2):
        if image_size % p == 0:
            return p
    return 1


@register_model("vit-tiny")
def build_vit_tiny(spec: ImageModelSpec) -> tuple[nn.Module, tuple[str, ...]]:
    from transformers import ViTConfig, ViTForImageClassification

    opts = {**VIT_TINY, "patch_size": _patch_size(spec.image_size), **spec.options}
    config = ViTConfig(
        image_size=spec.image_size,
        num_channels=spec.in_channels,
        num_labels=spec.num_classes,
        id2label=dict(enumerate(spec.label_names)),
        label2id={n: i for i, n in enumerate(spec.label_names)},
        # dropout off: DP noise already regularises, and per-example gradients of the
        # position embeddings need the undropped output gradient (grad_sample/vit.py)
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **opts,
    )
    return HFImageClassifier(ViTForImageClassification(config)), ("net.classifier",)


# -- building, loading, saving ---------------------------------------------------------------


def build_model(
    arch: str,
    label_names: Sequence[str],
    in_channels: int,
    image_size: int,
    seed: int | None = None,
    options: dict | None = None,
) -> ImageModel:
    if arch not in _FACTORY:
        raise ImageModelError(f"unknown image model {arch!r}; choose one of {model_names()}")
    spec = ImageModelSpec(
        arch, len(label_names), in_channels, image_size, tuple(label_names), dict(options or {})
    )
    if seed is not None:
        torch.manual_seed(seed)
    module, heads = _FACTORY[arch](spec)
    return ImageModel(module, spec, heads, arch, head_trained=False)


def load_image_model(
    name_or_path: str | os.PathLike,
    label_names: Sequence[str] | None = None,
    in_channels: int | None = None,
    image_size: int | None = None,
    seed: int | None = None,
    replace_batchnorm: bool = False,
) -> ImageModel:
    """A model from a factory name, a saved folder, a transformers folder or a torch file.

    A factory name needs the data's `label_names`, `in_channels` and `image_size`. A saved
    model keeps its own input shape (the data is resized to it); with other `label_names`
    its head is replaced by a fresh one (seeded) for the new classes.
    """
    s = str(name_or_path)
    if s in _FACTORY:
        if label_names is None or in_channels is None or image_size is None:
            raise ImageModelError(f"building {s!r} needs the data's classes, channels and size")
        return build_model(s, label_names, in_channels, image_size, seed)
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / SPEC_FILE).is_file():
        loaded = _load_saved(path)
    elif path.is_dir() and (path / "config.json").is_file():
        loaded = _load_transformers(path)
    elif path.is_file() and path.suffix in (".pt", ".pth"):
        loaded = _load_torch_module(path, label_names, in_channels, image_size)
    else:
        raise ImageModelError(
            f"--model {s!r} is not a factory name ({', '.join(model_names())}), a folder "
            f"written by dpfit (with {SPEC_FILE}), a transformers image-classification folder, "
            "or a .pt file with a torch nn.Module"
        )
    if replace_batchnorm:
        from dpfit.biases import replace_batchnorms

        if replace_batchnorms(loaded.module):  # the architecture changed: save it whole
            loaded.spec = replace(loaded.spec, arch="torch-module")
    if label_names is not None and tuple(label_names) != loaded.spec.label_names:
        _new_head(loaded, tuple(label_names), seed)
    return loaded


def _load_saved(path: Path) -> ImageModel:
    record = json.loads((path / SPEC_FILE).read_text())
    spec = ImageModelSpec.from_dict(record)
    if spec.arch == "torch-module":
        module = _unpickle(path / MODULE_FILE)
        heads = tuple(record.get("head_names", ()))
    elif spec.arch.startswith("hf:"):
        from transformers import AutoConfig, AutoModelForImageClassification

        config = AutoConfig.for_model(**record["hf_config"])
        module = HFImageClassifier(AutoModelForImageClassification.from_config(config))
        heads = tuple(record.get("head_names", ()))
        _load_weights(module, path)
    else:
        if spec.arch not in _FACTORY:
            raise ImageModelError(f"{path}: unknown architecture {spec.arch!r}")
        module, heads = _FACTORY[spec.arch](spec)
        _load_weights(module, path)
    extra = {"dpfit": record.get("dpfit", {})}
    return ImageModel(module, spec, heads, str(path), extra)


def _load_weights(module: nn.Module, path: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(path / WEIGHTS_FILE))
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ImageModelError(
            f"{path}: weights do not match the architecture (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )


def _load_transformers(path: Path) -> ImageModel:
    from transformers import AutoModelForImageClassification

    try:
        net = AutoModelForImageClassification.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ImageModelError(f"could not load an image classifier from {path}: {e}") from e
    cfg = net.config
    size = cfg.image_size if isinstance(cfg.image_size, int) else cfg.image_size[0]
    names = tuple(str(cfg.id2label[i]) for i in range(cfg.num_labels))
    spec = ImageModelSpec(f"hf:{cfg.model_type}", cfg.num_labels, cfg.num_channels, size, names)
    return ImageModel(HFImageClassifier(net), spec, ("net.classifier",), str(path))


def _unpickle(path: Path) -> nn.Module:
    module = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(module, nn.Module):
        raise ImageModelError(
            f"{path} holds a {type(module).__name__}, not an nn.Module; save the model with "
            "torch.save(model, path) (a state_dict alone does not say the architecture)"
        )
    return module


def _load_torch_module(path, label_names, in_channels, image_size) -> ImageModel:
    module = _unpickle(path)
    if in_channels is None or image_size is None:
        raise ImageModelError(f"{path}: a torch module needs the data's channels and size")
    last = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
    if not last:
        raise ImageModelError(f"{path}: no nn.Linear output layer to train as the head")
    out = module.get_submodule(last[-1]).out_features
    names = (
        tuple(label_names)
        if label_names and len(label_names) == out
        else tuple(str(i) for i in range(out))
    )
    spec = ImageModelSpec("torch-module", out, in_channels, image_size, names)
    return ImageModel(module, spec, (last[-1],), str(path))


def _new_head(model: ImageModel, label_names: tuple[str, ...], seed: int | None) -> None:
    """Replace the (last) head Linear with a fresh one sized for `label_names`."""
    if not model.head_names:
        raise ImageModelError(f"{model.source}: no head to resize for {len(label_names)} classes")
    name = model.head_names[-1]
    old = model.module.get_submodule(name)
    if not isinstance(old, nn.Linear):
        raise ImageModelError(f"{model.source}: head {name!r} is not an nn.Linear")
    if seed is not None:
        torch.manual_seed(seed)
    new = nn.Linear(old.in_features, len(label_names), bias=old.bias is not None)
    new.to(dtype=old.weight.dtype, device=old.weight.device)
    parent, _, leaf = name.rpartition(".")
    setattr(model.module.get_submodule(parent) if parent else model.module, leaf, new)
    net_config = getattr(getattr(model.module, "net", None), "config", None)
    if net_config is not None:
        net_config.num_labels = len(label_names)
        net_config.id2label = dict(enumerate(label_names))
        net_config.label2id = {n: i for i, n in enumerate(label_names)}
    logger.info("new head %s for %d classes (was %d)", name, len(label_names), old.out_features)
    model.spec = replace(model.spec, num_classes=len(label_names), label_names=label_names)
    model.head_trained = False


def save_image_model(
    model: ImageModel, folder: str | os.PathLike, record: dict | None = None
) -> Path:
    """DIR/dpfit-vision.json (spec, head, privacy/pretraining record) + weights."""
    from safetensors.torch import save_file

    from dpfit.reporting import write_json

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {**model.spec.as_dict(), "head_names": list(model.head_names), "dpfit": record or {}}
    if model.spec.arch == "torch-module":
        torch.save(model.module, folder / MODULE_FILE)
    else:
        state = {k: v.detach().cpu().contiguous() for k, v in model.module.state_dict().items()}
        save_file(state, str(folder / WEIGHTS_FILE))
        if model.spec.arch.startswith("hf:"):
            meta["hf_config"] = model.module.net.config.to_dict()
    write_json(folder / SPEC_FILE, meta)
    return folder


def read_record(path: str | os.PathLike | None) -> dict:
    """The dpfit record of a saved model folder: the privacy record (``dpfit.json``, written
    by the training loop for every task) and the pretraining split (``dpfit-vision.json``);
    {} for anything else."""
    if not is_image_model_folder(path):
        return {}
    record = dict(json.loads((Path(path) / SPEC_FILE).read_text()).get("dpfit", {}))
    privacy = Path(path) / PRIVACY_FILE
    if privacy.is_file():
        record = {**json.loads(privacy.read_text()), **record}
    return record


def is_image_model_folder(path: str | os.PathLike | None) -> bool:
    return path is not None and (Path(path) / SPEC_FILE).is_file()

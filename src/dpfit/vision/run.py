"""Private (or public, non-private) training of an image classifier, end to end.

One function, :func:`train_images`, with one frozen :class:`VisionConfig`, behind both
``dpfit train --task image-classification`` (private fine-tuning; DP-BiTFiT, DP full, DP
last-layer, or two-phase X+BiTFiT under one budget) and ``dpfit pretrain`` (non-private
training on a split declared public). Same loop as the text path: the PrivacyEngine with
Poisson sampling, or plain shuffled batches when non-private; checkpoints every few logical
steps that a killed run resumes from bit-for-bit.

The public/private split is a seeded random fraction of the training data
(:func:`dpfit.vision.data.public_private_split`). Pretraining records it in the saved
model, and private fine-tuning of that model on the same data reuses it and refuses a split
that would make the private set overlap the examples the model has already seen.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dpfit import checkpoint as ckpt
from dpfit.errors import BudgetExhaustedError, DPFitError
from dpfit.reporting import StepRow, peak_memory_mb, plot_steps, write_json, write_steps_csv
from dpfit.vision.data import (
    FASHION_MNIST,
    ImageCollate,
    ImageData,
    load_images,
    public_private_split,
    relabel,
)
from dpfit.vision.models import ImageModel, load_image_model, read_record, save_image_model

logger = logging.getLogger(__name__)

DEFAULT_DELTA = 1e-5
MODES = ("bias", "full", "head")  # head: DP last-layer (only the classification head trains)
SPLITS = ("private", "public")
HELD_OUT = 0.1  # test share held out of a user's data set when no --eval-data is given


@dataclass(frozen=True)
class VisionConfig:
    """Everything that defines an image run. Fields in RESUMABLE may differ on --resume."""

    model: str = "resnet-gn"  # factory name, saved folder, transformers folder, .pt module
    data: str | None = None  # None: bundled FashionMNIST (train split)
    eval_data: str | None = None  # None: FashionMNIST test split / 10% held out of `data`
    split: str = "private"  # which side of the public/private split to train on
    public_fraction: float | None = None  # None: as recorded by the pretrained model, else 0
    split_seed: int | None = None  # seeds the public/private split and the held-out test
    # share; None: as recorded by the pretrained model, else 0
    image_size: int | None = None  # square input size (upsampled); None: the data's / model's
    max_train_examples: int | None = None
    max_eval_examples: int | None = None
    epsilon: float | None = 8.0
    delta: float | None = None  # None: min(1e-5, 1/n^1.1)
    noise_multiplier: float | None = None
    accountant: str = "rdp"
    epochs: int = 3
    max_steps: int | None = None
    batch_size: int = 256
    physical_batch_size: int = 64
    max_grad_norm: float = 1.0
    clipping: str = "flat"
    lr: float = 1e-3
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    seed: int = 0  # public randomness only: head init, shuffles of the non-private path
    insecure_seed: int | None = None  # seeds noise and sampling: NOT private against its holder
    non_private: bool = False
    mode: str = "bias"
    full_epochs: int = 0
    replace_batchnorm: bool = False
    output: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 1
    resume: bool = False
    device: str = "auto"
    eval_batch_size: int = 256

    RESUMABLE = (
        "output",
        "checkpoint_dir",
        "checkpoint_every",
        "resume",
        "device",
        "eval_batch_size",
    )

    def __post_init__(self) -> None:
        from dpfit.train import OPTIMIZERS

        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {self.split!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}")
        for name in ("epochs", "batch_size", "physical_batch_size", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.public_fraction is not None and not 0 <= self.public_fraction < 1:
            raise ValueError(f"public_fraction must be in [0, 1), got {self.public_fraction}")
        if self.image_size is not None and self.image_size < 4:
            raise ValueError(f"image_size must be >= 4, got {self.image_size}")
        if not self.non_private and self.noise_multiplier is None and self.epsilon is None:
            raise ValueError("give a target epsilon or a noise multiplier (or non_private)")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint_dir")
        if self.full_epochs:
            if self.non_private:
                raise DPFitError("--full-epochs schedules a private run; drop --non-private")
            if self.mode != "bias":
                raise DPFitError("--full-epochs X already runs X epochs in full mode; drop --mode")
            if not 0 < self.full_epochs < self.epochs:
                raise DPFitError(
                    f"--full-epochs must be between 1 and --epochs - 1 ({self.epochs - 1}), "
                    f"got {self.full_epochs}"
                )
        if self.split == "public" and not self.non_private:
            raise DPFitError("training on the public split is non-private (dpfit pretrain)")

    def fingerprint(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if k not in self.RESUMABLE}


@dataclass
class VisionResult:
    metrics: dict
    steps: list[StepRow]
    model: ImageModel
    privacy: dict | None
    notes: list[str] = field(default_factory=list)
    output_dir: Path | None = None


# -- data ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedImages:
    train: ImageData
    test: ImageData
    public_split: dict | None  # {"source", "fraction", "seed", "n_public"} when one was made
    notes: tuple[str, ...]


def _is_bundled(spec: str | None) -> bool:
    return spec is None or spec == FASHION_MNIST


def prepare_images(config: VisionConfig, recorded_split: dict | None = None) -> PreparedImages:
    """Training and test images; the public/private split made (or inherited) and checked."""
    notes: list[str] = []
    source = FASHION_MNIST if _is_bundled(config.data) else str(config.data)
    fraction, seed = config.public_fraction, config.split_seed
    same_source = bool(recorded_split) and recorded_split.get("source") == source
    if same_source and "seed" not in recorded_split and config.split == "private":
        raise DPFitError(
            f"the model was pretrained non-privately on all of {source}; private fine-tuning "
            "on the same data protects nothing. Pretrain on a public share "
            "(--public-fraction) or on separate public data"
        )
    if same_source and "seed" in recorded_split:
        rec = (float(recorded_split["fraction"]), int(recorded_split["seed"]))
        if config.split == "private" and (fraction, seed) not in (
            (None, None),
            (None, rec[1]),
            rec,
        ):
            raise DPFitError(
                f"the model was pretrained non-privately on a public {rec[0]:g} of {source} "
                f"(split seed {rec[1]}); a private split with fraction "
                f"{rec[0] if fraction is None else fraction:g} and seed "
                f"{0 if seed is None else seed} would include some of those examples. Use "
                f"--public-fraction {rec[0]:g} --split-seed {rec[1]} (or leave both out)"
            )
        if config.split == "private" and fraction is None:
            fraction, seed = rec
            notes.append(
                f"public split from the pretrained model's record: {rec[0]:g} of {source} "
                f"(seed {rec[1]}) is public and excluded from private training"
            )
    seed = 0 if seed is None else seed
    data = load_images(config.data, "train", image_size=config.image_size)
    if config.eval_data is not None:
        split = "test" if _is_bundled(config.eval_data) else "train"
        test = load_images(config.eval_data, split, data.label_names, image_size=config.image_size)
    elif _is_bundled(config.data):
        test = load_images(None, "test")
    else:
        data, test = data.split(HELD_OUT, seed=seed)
        notes.append(
            f"no --eval-data: holding out a random {HELD_OUT:.0%} of {config.data} as the test "
            f"set ({len(test)} images, split seed {seed})"
        )
    public_split = None
    if fraction:
        public, private = public_private_split(data, fraction, seed)
        public_split = {
            "source": source,
            "fraction": fraction,
            "seed": seed,
            "n_public": len(public),
            "n_private": len(private),
        }
        data = public if config.split == "public" else private
        notes.append(
            f"{config.split} split: {len(data)} of {len(public) + len(private)} training images "
            f"({fraction:g} public, split seed {seed})"
        )
    elif config.split == "public":
        notes.append(f"all of {source} is treated as public (no --public-fraction)")
        public_split = {"source": source, "fraction": 1.0}
    if config.max_train_examples is not None and config.max_train_examples < len(data):
        notes.append(f"training on a random {config.max_train_examples} of {len(data)} images")
        data = data.subsample(config.max_train_examples, seed=config.seed)
    if config.max_eval_examples is not None and config.max_eval_examples < len(test):
        notes.append(f"evaluating on a random {config.max_eval_examples} of {len(test)} images")
        test = test.subsample(config.max_eval_examples, seed=config.seed)
    return PreparedImages(data, test, public_split, tuple(notes))


# -- evaluation ------------------------------------------------------------------------------


@torch.no_grad()
def evaluate_images(
    model: ImageModel, data: ImageData, batch_size: int = 256, device: str | torch.device = "cpu"
) -> dict:
    """Accuracy and per-class counts of `model` on `data` (relabelled to the model's classes)."""
    data = relabel(data, model.spec.label_names)
    collate = ImageCollate(data, model.spec.in_channels, model.spec.image_size)
    module = model.module
    was_training = module.training
    module.eval()
    preds = []
    for start in range(0, len(data), batch_size):
        b = collate(list(range(start, min(start + batch_size, len(data)))))
        preds.append(module(b["pixel_values"].to(device)).argmax(-1).cpu())
    module.train(was_training)
    pred = torch.cat(preds).numpy() if preds else np.zeros(0, dtype=np.int64)
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


# -- model -----------------------------------------------------------------------------------


def _select_trainables(model: ImageModel, config: VisionConfig):
    import dpfit
    from dpfit.params import summarize

    module = model.module
    mode = config.mode
    if mode == "full":
        for p in module.parameters():
            p.requires_grad_(True)
        return summarize(module)
    if mode == "head":
        heads = model.head_names
        if not heads:
            raise DPFitError(f"{model.source}: no head module to train (mode head)")
        for n, p in module.named_parameters():
            p.requires_grad_(any(n == h or n.startswith(h + ".") for h in heads))
        return summarize(module)
    return dpfit.make_bias_trainable(module, train_head=model.head_names)


def _make_engine(module, config: VisionConfig, n: int, total_steps: int):
    import dpfit

    delta = config.delta if config.delta is not None else min(DEFAULT_DELTA, n**-1.1)
    kwargs = dict(
        expected_batch_size=min(config.batch_size, n),
        sample_size=n,
        target_delta=delta,
        max_grad_norm=config.max_grad_norm,
        clipping=config.clipping,
        loss_reduction="mean",
        accountant=config.accountant,
        insecure_seed=config.insecure_seed,
    )
    if config.full_epochs:  # two-phase X+BiTFiT: one accountant across both phases
        kwargs["schedule"] = [
            ("full", config.full_epochs),
            ("bias", config.epochs - config.full_epochs),
        ]
    else:
        kwargs["mode"] = "full" if config.mode == "full" else "bias"
    if config.noise_multiplier is not None:
        kwargs["noise_multiplier"] = config.noise_multiplier
    else:
        kwargs["target_epsilon"] = config.epsilon
        kwargs["steps"] = total_steps
    return dpfit.PrivacyEngine(module, **kwargs)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# -- the run ---------------------------------------------------------------------------------


def train_images(
    config: VisionConfig,
    on_step: Callable[[StepRow, int], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> VisionResult:
    """Run one image training job as configured (see the module docstring)."""
    from dpfit.train import OPTIMIZERS, PlainStepper, ShuffledBatches

    t_start = time.perf_counter()
    notes: list[str] = []

    def note(msg: str) -> None:
        notes.append(msg)
        logger.info(msg)
        if on_note is not None:
            on_note(msg)

    device = _device(config.device)
    torch.manual_seed(config.seed)
    data = prepare_images(config, read_record(config.model).get("pretrained_on"))
    model = _load_model_for(config, data.train)
    for n_ in data.notes:
        note(n_)
    if config.insecure_seed is not None and not config.non_private:
        note(
            f"insecure seed {config.insecure_seed}: noise and sampling are reproducible, and "
            "NOT private against anyone who knows the seed"
        )
    summary = _select_trainables(model, config)
    module = model.module.to(device)
    module.train()
    train = relabel(data.train, model.spec.label_names)
    collate = ImageCollate(train, model.spec.in_channels, model.spec.image_size)
    items = range(len(train))
    n = len(train)
    steps_per_epoch = (
        math.ceil(n / config.batch_size)
        if config.non_private
        else max(1, round(n / min(config.batch_size, n)))
    )
    total_steps = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)

    engine = None
    if config.non_private:
        loader = ShuffledBatches(
            items, config.batch_size, config.physical_batch_size, collate, config.seed
        )
        stepper = PlainStepper(loader)
        params = [p for p in module.parameters() if p.requires_grad]
    else:
        engine = _make_engine(module, config, n, total_steps)
        loader = engine.data_loader(
            items, collate_fn=collate, physical_batch_size=config.physical_batch_size
        )
        stepper = engine
        params = list(engine.parameters())
    optimizer = OPTIMIZERS[config.optimizer](params, config.lr, config.weight_decay)

    def enter_bias_phase(opt):
        if engine is None or engine.mode == "bias":
            return opt
        opt = engine.switch_phase("bias", opt)
        note(
            f"phase switch: full -> bias after {engine.steps_taken} steps (eps {engine.epsilon():.3f})"
        )
        return opt

    rows: list[StepRow] = []
    epoch = 0
    elapsed_before = 0.0
    save_all = config.full_epochs > 0
    if config.resume:
        path = ckpt.latest_checkpoint(config.checkpoint_dir)
        if path is None:
            note(f"--resume: no checkpoint in {config.checkpoint_dir}; starting from scratch")
        else:
            state = ckpt.load_checkpoint(path)
            ckpt.check_compatible(
                state["config"], config.fingerprint(), tuple(config.fingerprint())
            )
            ckpt.load_trainable_state(module, state["trainable"])
            if (
                engine is not None
                and config.full_epochs
                and int(state["epoch"]) >= config.full_epochs
            ):
                optimizer = enter_bias_phase(optimizer)
            optimizer.load_state_dict(state["optimizer"])
            stepper.load_state_dict(state["stepper"])
            loader.load_state_dict(state["loader"])
            ckpt.set_rng_state(state["rng"])
            rows = [StepRow(**r) for r in state["rows"]]
            epoch = int(state["epoch"])
            elapsed_before = float(state["elapsed_s"])
            note(f"resumed from {path.name}: logical step {len(rows)}, epoch {epoch + 1}")

    t_loop = time.perf_counter()

    def save(epoch_now: int) -> None:
        if not config.checkpoint_dir:
            return
        ckpt.save_checkpoint(
            config.checkpoint_dir,
            stepper.steps_taken,
            {
                "config": config.fingerprint(),
                "trainable": ckpt.trainable_state(module, everything=save_all),
                "optimizer": optimizer.state_dict(),
                "stepper": stepper.state_dict(),
                "loader": loader.state_dict(),
                "rng": ckpt.rng_state(),
                "rows": [dataclasses.asdict(r) for r in rows],
                "epoch": epoch_now,
                "elapsed_s": elapsed_before + time.perf_counter() - t_loop,
            },
        )

    acc_loss, acc_n = 0.0, 0

    def record(epoch_now: int) -> None:
        nonlocal acc_loss, acc_n
        eps = stepper.epsilon()
        while len(rows) < stepper.steps_taken:
            current = len(rows) == stepper.steps_taken - 1
            rows.append(
                StepRow(
                    step=len(rows) + 1,
                    epoch=epoch_now + 1,
                    # the exact loss and batch size of a private step are un-noised
                    # statistics of private data: written for non-private runs only
                    loss=acc_loss / acc_n if (config.non_private and current and acc_n) else None,
                    epsilon=eps,
                    elapsed_s=elapsed_before + time.perf_counter() - t_loop,
                )
            )
            if on_step is not None:
                on_step(rows[-1], total_steps)
        acc_loss, acc_n = 0.0, 0

    stopped = len(rows) >= total_steps
    try:
        while epoch < config.epochs and not stopped:
            if config.full_epochs and epoch >= config.full_epochs:
                optimizer = enter_bias_phase(optimizer)
            for batch in loader:
                weight = batch.pop("_weight", 1.0)
                x = batch["pixel_values"].to(device)
                y = batch["labels"].to(device)
                loss = F.cross_entropy(module(x), y)
                (loss * weight).backward()
                acc_loss += float(loss.detach()) * len(y)
                acc_n += len(y)
                if stepper.step(optimizer):
                    record(epoch)
                    if len(rows) % config.checkpoint_every == 0 or len(rows) >= total_steps:
                        save(epoch)
                    if len(rows) >= total_steps:
                        stopped = True
                        break
            else:
                epoch += 1
                record(epoch - 1)
                if len(rows) >= total_steps:
                    stopped = True
    except BudgetExhaustedError as e:
        note(f"stopped early: {e}")
    train_time = elapsed_before + time.perf_counter() - t_loop

    privacy = None
    if engine is not None:
        privacy = dict(engine.privacy_record())
        privacy["insecure_seed"] = config.insecure_seed is not None
        engine.detach()
    module.eval()
    accuracy = evaluate_images(model, data.test, config.eval_batch_size, device)
    metrics = {
        "task": "image-classification",
        "accuracy": accuracy["accuracy"],
        "eval_n": accuracy["n"],
        "per_class": accuracy["per_class"],
        "eval_source": data.test.source,
        "train_source": data.train.source,
        "private": not config.non_private,
        "epsilon": privacy["epsilon"] if privacy else math.inf,
        "delta": (privacy or {}).get("delta"),
        "noise_multiplier": (privacy or {}).get("noise_multiplier"),
        "sample_rate": (privacy or {}).get("sample_rate"),
        "insecure_seed": config.insecure_seed is not None and not config.non_private,
        "max_grad_norm": None if config.non_private else config.max_grad_norm,
        "clipping": None if config.non_private else config.clipping,
        "steps": len(rows),
        "epochs": config.epochs,
        "batch_size": config.batch_size,
        "train_examples": len(train),
        "trainable_params": summary.trainable,
        "total_params": summary.total,
        "trainable_fraction": summary.fraction,
        "mode": config.mode if not config.full_epochs else f"{config.full_epochs}+bias",
        "model": model.spec.arch,
        "image_size": model.spec.image_size,
        "public_split": data.public_split,
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - t_start,
        "peak_memory_mb": peak_memory_mb(device.type),
        "final_loss": next(
            (r.loss for r in reversed(rows) if r.loss is not None and not math.isnan(r.loss)), None
        ),
        "config": dataclasses.asdict(config),
    }
    result = VisionResult(metrics, rows, model, privacy, notes)
    if config.output:
        result.output_dir = _save_outputs(result, config, data)
    return result


def _load_model_for(config: VisionConfig, train: ImageData) -> ImageModel:
    """The model named by config.model, with a head for the data's classes."""
    return load_image_model(
        config.model,
        label_names=train.label_names,
        in_channels=train.channels,
        image_size=config.image_size or max(train.size),
        seed=config.seed,
        replace_batchnorm=config.replace_batchnorm,
    )


def _save_outputs(result: VisionResult, config: VisionConfig, data: PreparedImages) -> Path:
    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    record = {"private": result.privacy is not None, **(result.privacy or {})}
    record["trainable_fraction"] = result.metrics["trainable_fraction"]
    record["mode"] = result.metrics["mode"]
    previous = result.model.extra.get("dpfit", {})
    if config.split == "public":
        record["pretrained_on"] = data.public_split or {"source": data.train.source}
    elif previous.get("pretrained_on"):
        record["pretrained_on"] = previous["pretrained_on"]
    save_image_model(result.model, out / "model", record)
    write_steps_csv(out / "steps.csv", result.steps, private=not config.non_private)
    plot_steps(result.steps, out)
    write_json(out / "metrics.json", result.metrics)
    return out

"""What defines a run (:class:`TrainConfig`, frozen) and what it returns (:class:`TrainResult`).

A plug-in (task, window, recipe) may import this module; it imports no stage of the run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dpfit.accounting import check_neighbouring
from dpfit.config import LORA_MODES
from dpfit.data.rowhash import SPLIT_RULE
from dpfit.dropout import check_rate as check_dropout_rate
from dpfit.lr_schedules import LR_SCHEDULES
from dpfit.precision import PRECISIONS
from dpfit.recipe import Recipe
from dpfit.reporting import StepRow
from dpfit.tasks.pooling import POOLINGS
from dpfit.windows import PRIVACY_UNITS

CLIPPING = ("flat", "automatic")

MODES = ("bias", "full", "bias+lora", "lora")

TASKS = ("classification", "causal-lm", "image-classification")

WINDOWED_TASKS = ("causal-lm", "classification")  # tasks that cut long texts (dpfit.windows)

OPTIMIZERS = {
    "adamw": lambda params, lr, wd: torch.optim.AdamW(params, lr=lr, weight_decay=wd),
    "sgd": lambda params, lr, wd: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd),
}


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run. Fields marked (resume) may differ on --resume."""

    model: str | None = None  # folder, .gguf file or hub id; None = bundled MiniLM
    data: str | None = None  # CSV/JSONL/datasets folder; None = bundled Rotten Tomatoes
    eval_data: str | None = None  # scored at the end; default: test split / held-out 10%
    text_column: str = "text"
    label_column: str = "label"
    max_train_examples: int | None = None  # random subset of the training data
    epsilon: float | None = 8.0
    delta: float | None = None  # None: min(1e-5, 1/n^1.1)
    noise_multiplier: float | None = None  # overrides epsilon
    accountant: str = "rdp"
    neighbouring: str = "add-remove"  # the relation epsilon is calibrated to; both reported
    # None = the recipe's value (dpfit.recipe.resolve_recipe); a value overrides it
    epochs: int | None = None
    max_steps: int | None = None  # stop after this many logical steps (privacy sized for it)
    batch_size: int | None = None  # logical; expected size under Poisson sampling
    physical_batch_size: int | None = None
    max_grad_norm: float | None = None
    clipping: str | None = None
    lr: float | None = None
    lr_schedule: str = "constant"  # constant | cosine (dpfit.lr_schedules), per logical step
    optimizer: str = "adamw"  # adamw | sgd (momentum 0.9)
    weight_decay: float = 0.0
    max_length: int | None = None
    # long texts (causal LM, classification; dpfit.windows): a window every `stride` tokens
    # (None: no overlap), and what epsilon protects: one window, or one whole document (all
    # its windows as one)
    stride: int | None = None
    privacy_unit: str = "window"
    # privacy_unit "user": the column that says whose each row is, and how many of a user's
    # rows train at most (None: dpfit.data.text.MAX_ROWS_PER_USER), chosen by a keyed row hash
    user_column: str | None = None
    max_rows_per_user: int | None = None
    # bias mode: recompute activations in the backward pass (dpfit.activation_checkpointing)
    activation_checkpointing: bool = False
    # causal LM on documents: every physical batch padded to the window length, so its shape,
    # memory and time never depend on how long the sampled documents are
    pad_to_max_length: bool = False
    pooling: str = "auto"  # auto | cls | pooler | mean | last
    # the backbone's dropout rate, set in its config before it is built (dpfit.dropout):
    # None: the recipe's (off when private); "model": the model's own rates
    dropout: float | str | None = None
    # private linear probe on frozen features, then biases + head; None: the recipe decides
    head_first: bool | None = None
    head_epochs: int | None = None  # epochs of the head-first phase
    head_lr: float | None = None  # learning rate of the head-first phase
    seed: int = 0  # public randomness only: split, head init, non-private shuffles
    insecure_reproducible_noise: bool = False  # also seed noise + sampling: NOT private
    labels: tuple[str, ...] | None = None  # public label names given by the user
    public_labels: bool = False  # declare label names read from the data public
    non_private: bool = False
    mode: str = "bias"
    add_biases: bool = False  # BiTFiT-Add: zero biases where the model has none
    full_epochs: int = 0  # two-phase X+BiTFiT: X epochs of full fine-tuning first
    full_lr: float | None = None  # their rate (None: the recipe's); lr is the bias phase's
    # --mode bias+lora / lora (dpfit.params.add_lora): rank, scale alpha/r, targets (None:
    # peft's attention query/value projections for the model type)
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] | None = None
    # FFA-LoRA: lora_A stays at its random init, lora_B trains (None: the recipe's choice)
    lora_freeze_a: bool | None = None
    task: str = "classification"
    task_options: Any = None  # the task's own settings (a frozen dataclass, e.g. ImageOptions)
    output: str | None = None  # (resume)
    checkpoint_dir: str | None = None  # (resume)
    checkpoint_every: int = 1  # (resume) logical steps between checkpoints
    resume: bool = False  # (resume)
    allow_fork: bool = False  # (resume) continue a checkpoint that was already continued
    device: str = "auto"  # (resume)
    eval_batch_size: int = 64  # (resume)
    precision: str = "fp32"  # (resume) fp32 | bf16 | auto: forward/backward dtype (dpfit.precision)

    def __post_init__(self) -> None:
        if self.clipping is not None and self.clipping not in CLIPPING:
            raise ValueError(f"clipping must be one of {CLIPPING}, got {self.clipping!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.lora_r < 1 or not self.lora_alpha > 0:
            raise ValueError(
                f"--lora-r must be >= 1 and --lora-alpha > 0, got {self.lora_r}, {self.lora_alpha}"
            )
        if self.lora_freeze_a and self.mode not in LORA_MODES:
            raise ValueError(
                f"--lora-freeze-a applies to --mode bias+lora or lora, not --mode {self.mode}"
            )
        check_neighbouring(self.neighbouring)
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"lr_schedule must be one of {sorted(LR_SCHEDULES)}, got {self.lr_schedule!r}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {sorted(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        for name in (
            "epochs",
            "batch_size",
            "physical_batch_size",
            "max_length",
            "stride",
            "checkpoint_every",
            "max_rows_per_user",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.privacy_unit not in PRIVACY_UNITS:
            raise ValueError(
                f"privacy_unit must be one of {PRIVACY_UNITS}, got {self.privacy_unit!r}"
            )
        check_dropout_rate(self.dropout)
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be > 0, got {self.max_grad_norm}")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.head_lr is not None and not self.head_lr > 0:
            raise ValueError(f"head_lr must be > 0, got {self.head_lr}")
        if self.full_lr is not None and not self.full_lr > 0:
            raise ValueError(f"full_lr must be > 0, got {self.full_lr}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        if not self.non_private and self.noise_multiplier is None and self.epsilon is None:
            raise ValueError("give a target epsilon or a noise multiplier (or non_private)")
        if self.resume and not self.checkpoint_dir:
            raise ValueError(
                "--resume needs --checkpoint-dir DIR, the folder the interrupted run wrote its "
                "checkpoints to (a new run needs no --resume)"
            )
        if self.labels is not None:
            object.__setattr__(self, "labels", tuple(str(x).strip() for x in self.labels))
            if len(set(self.labels)) != len(self.labels) or len(self.labels) < 2:
                raise ValueError(
                    f"labels must name at least two distinct classes, got {list(self.labels)}"
                )

    # Settings that may change between a run and its resumption without changing the result.
    RESUMABLE = (
        "output",
        "checkpoint_dir",
        "checkpoint_every",
        "resume",
        "allow_fork",
        "device",
        "eval_batch_size",
        "precision",
        "activation_checkpointing",
        "pad_to_max_length",
    )

    RECIPE_FIELDS = (
        "batch_size",
        "epochs",
        "lr",
        "max_grad_norm",
        "clipping",
        "max_length",
        "physical_batch_size",
        "head_epochs",
        "head_lr",
        "full_lr",
        "dropout",
        "lora_freeze_a",
    )

    def overrides(self) -> tuple[str, ...]:
        """The recipe fields this config sets itself."""
        return tuple(f for f in self.RECIPE_FIELDS if getattr(self, f) is not None)

    def with_recipe(self, recipe: Recipe) -> TrainConfig:
        """This config with every unset recipe field taken from `recipe`."""
        filled = {f: getattr(recipe, f) for f in self.RECIPE_FIELDS if getattr(self, f) is None}
        if self.head_first is False or not (self.head_epochs or recipe.head_epochs):
            filled["head_epochs"] = 0
            filled["head_lr"] = None
        return dataclasses.replace(self, **filled)

    def fingerprint(self) -> dict:
        """What a checkpoint must match to be resumed: the settings, and the rule that split
        the data (a checkpoint of an older rule trained on rows that may now be held out)."""
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if k not in self.RESUMABLE} | {"split_rule": SPLIT_RULE}


@dataclass
class TrainResult:
    metrics: dict
    steps: list[StepRow]
    model: object
    tokenizer: object
    privacy: dict | None
    notes: list[str] = field(default_factory=list)
    output_dir: Path | None = None

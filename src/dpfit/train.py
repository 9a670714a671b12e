"""The training run behind ``dpfit train``: task -> recipe -> private (or plain) loop -> report.

One function, :func:`train`, with one frozen :class:`TrainConfig`, so the CLI, the benchmarks
and a user's script run exactly the same code, for every task (:mod:`dpfit.tasks`: the task
supplies data, model and head, loss and metric). Every default comes from
:func:`dpfit.recipe.resolve_recipe`, a function of public quantities only. The private and
non-private runs share the loop; only the stepper differs (the PrivacyEngine with Poisson
sampling, or a plain optimizer over shuffled fixed-size batches), which is what makes their
comparison meaningful.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dpfit import checkpoint as ckpt
from dpfit import outputs, progress
from dpfit.accounting import check_neighbouring
from dpfit.attention import EAGER_MAX_LENGTH, choose_attention
from dpfit.config import LORA_MODES
from dpfit.distributed import is_main_process
from dpfit.dropout import MODEL as DROPOUT_MODEL
from dpfit.dropout import check_rate as check_dropout_rate
from dpfit.errors import BudgetExhaustedError, DPFitError, NoTrainableParametersError
from dpfit.frozen_casts import FrozenWeightCasts
from dpfit.lr_schedules import LR_SCHEDULES, lr_factor, set_lr
from dpfit.models import count_bias_parameters
from dpfit.precision import PRECISIONS, autocast, resolve_precision
from dpfit.recipe import (
    Recipe,
    default_delta,
    default_dropout,
    default_lora_freeze_a,
    physical_batch_for,
    resolve_recipe,
)
from dpfit.reporting import StepRow, peak_memory_mb, plot_steps, write_json, write_steps_csv
from dpfit.tasks import Prepared, Task, get_task
from dpfit.tasks.classification import (  # noqa: F401 - re-exported for scripts and benchmarks
    MIN_PUBLIC_LABEL_COUNT,
    EvalResult,
    PreparedData,
    RareLabelError,
    encode,
    evaluate,
    make_collate,
    prepare_data,
)
from dpfit.tasks.pooling import POOLINGS

# PRIVACY_UNITS: "window" (each window of a document is one example) or "document" (all of a
# document's windows sampled and clipped as one: the engine's privacy_unit="document")
from dpfit.windows import PRIVACY_UNITS, check_stride

logger = logging.getLogger(__name__)

CLIPPING = ("flat", "automatic")
MODES = ("bias", "full", "bias+lora", "lora")
TASKS = ("classification", "causal-lm", "image-classification")
WINDOWED_TASKS = ("causal-lm", "classification")  # tasks that cut long texts (dpfit.windows)
OPTIMIZERS = {
    "adamw": lambda params, lr, wd: torch.optim.AdamW(params, lr=lr, weight_decay=wd),
    "sgd": lambda params, lr, wd: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd),
}


class PhysicalBatchMemoryError(DPFitError, MemoryError):
    """A physical batch did not fit in memory."""


OutputError = outputs.OutputError  # re-exported: raised when an output cannot be written


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
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if k not in self.RESUMABLE}


@dataclass
class TrainResult:
    metrics: dict
    steps: list[StepRow]
    model: object
    tokenizer: object
    privacy: dict | None
    notes: list[str] = field(default_factory=list)
    output_dir: Path | None = None


# -- the non-private stepper: same loop, no clipping or noise ---------------------------------


class ShuffledBatches:
    """Fixed-size shuffled logical batches split into physical ones; resumable by position.

    The order of a pass depends only on (seed, epoch), so the state is two integers.
    """

    def __init__(
        self, dataset: Sequence, batch_size: int, physical_batch_size: int, collate, seed: int
    ):
        self.dataset = dataset
        self.batch_size = batch_size
        self.physical_batch_size = physical_batch_size
        self.collate = collate
        self.seed = seed
        self.epoch = 0
        self.position = 0  # logical batches completed in this epoch
        self.last_chunk = False
        self.logical_size = 0

    def __len__(self) -> int:
        return math.ceil(len(self.dataset) / self.batch_size)

    def __iter__(self) -> Iterator[dict]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        perm = torch.randperm(len(self.dataset), generator=gen).tolist()
        while self.position < len(self):
            idx = perm[self.position * self.batch_size : (self.position + 1) * self.batch_size]
            self.position += 1
            self.logical_size = len(idx)
            idx = sorted(idx)  # the data is sorted by length: chunks pad little
            chunks = [
                idx[i : i + self.physical_batch_size]
                for i in range(0, len(idx), self.physical_batch_size)
            ]
            for j, chunk in enumerate(chunks):
                self.last_chunk = j == len(chunks) - 1
                batch = self.collate([self.dataset[i] for i in chunk])
                batch["_weight"] = len(chunk) / len(idx)
                yield batch
        self.position = 0
        self.epoch += 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.position = int(sd["epoch"]), int(sd["position"])


class PlainStepper:
    """The `engine.step` contract without privacy: step the optimizer after each logical batch."""

    def __init__(self, loader: ShuffledBatches):
        self.loader = loader
        self.steps_taken = 0

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        if not self.loader.last_chunk:
            return False
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.steps_taken += 1
        return True

    def epsilon(self) -> float:
        return math.inf

    def state_dict(self) -> dict:
        return {"steps_taken": self.steps_taken}

    def load_state_dict(self, sd: dict) -> None:
        self.steps_taken = int(sd["steps_taken"])


# -- the run ---------------------------------------------------------------------------------


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and (
        "out of memory" in msg or "can't allocate memory" in msg or "not enough memory" in msg
    )


def _oom_error(config: TrainConfig, e: BaseException) -> PhysicalBatchMemoryError:
    smaller = max(1, config.physical_batch_size // 2)
    text = config.task != "image-classification"  # images have no max length to lower
    return PhysicalBatchMemoryError(
        f"a physical batch of up to {config.physical_batch_size} examples"
        + (f" (max length {config.max_length})" if text else "")
        + f" did not fit in memory; retry with --physical-batch-size {smaller} (the logical "
        "batch and the privacy guarantee stay the same)"
        + (" or a smaller --max-length" if text else "")
        + f". ({type(e).__name__}: {str(e)[:200]})"
    )


@contextlib.contextmanager
def _oom_guard(config: TrainConfig):
    """Turn an out-of-memory error into one that says which flag to change."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if _is_oom(e):
            raise _oom_error(config, e) from e
        raise


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def _insecure_seed(config: TrainConfig, offset: int = 0) -> int | None:
    """--seed is public: noise and sampling use OS randomness unless the user opts out."""
    if not config.insecure_reproducible_noise:
        return None
    return config.seed + offset


def _check_options(config: TrainConfig) -> None:
    """Combinations that cannot run, found before any data is read."""
    if config.full_epochs:
        if config.non_private:
            raise DPFitError("--full-epochs schedules a private run; drop --non-private")
        if config.mode != "bias":
            raise DPFitError("--full-epochs X already runs X epochs in full mode; drop --mode")
    if config.head_first:  # asked for explicitly
        if config.task != "classification":
            raise DPFitError("--head-first trains a classification head; drop it for this task")
        if config.full_epochs:
            raise DPFitError("--head-first and --full-epochs are separate schedules; pick one")
    if config.head_epochs and config.full_epochs:
        raise DPFitError("--head-epochs and --full-epochs are separate schedules; pick one")
    if config.full_lr is not None and not config.full_epochs:
        raise DPFitError("--full-lr is the rate of the --full-epochs phase; add --full-epochs X")
    if config.task == "causal-lm" and config.non_private:
        raise DPFitError(f"--task {config.task} runs privately only; drop --non-private")
    if config.task not in WINDOWED_TASKS and (config.privacy_unit != "window" or config.stride):
        raise DPFitError(
            "--privacy-unit document and --stride cut long texts into token windows, for --task "
            f"{' or '.join(WINDOWED_TASKS)} only; drop them for --task {config.task}"
        )
    if config.stride is not None and config.max_length is not None:
        check_stride(config.stride, config.max_length)
    if config.privacy_unit == "document" and config.non_private:
        raise DPFitError(
            "--privacy-unit document is what a private run's epsilon protects; a --non-private "
            "run has none: use --privacy-unit window (the same windows, each one example)"
        )
    if config.privacy_unit == "document" and (config.head_first or config.head_epochs):
        raise DPFitError(
            "--head-first / --head-epochs train the head on each window's features as one "
            "example, which --privacy-unit document does not allow; drop them (the document "
            "unit trains without the head-first phase) or use --privacy-unit window"
        )
    if config.privacy_unit == "document" and (config.mode != "bias" or config.full_epochs):
        raise DPFitError(
            "--privacy-unit document sums a document's per-example bias gradients before the "
            "clip: --mode bias only (without --full-epochs); use --privacy-unit window"
        )
    if config.pad_to_max_length and config.task != "causal-lm":
        raise DPFitError(
            "--pad-to-max-length pads the windows of documents for --task causal-lm; drop it "
            f"for --task {config.task}"
        )
    if config.activation_checkpointing and (config.mode != "bias" or config.full_epochs):
        raise DPFitError(
            "--activation-checkpointing is for --mode bias (per-example bias gradients read "
            "from the backward pass) without --full-epochs; drop it, or lower "
            "--physical-batch-size"
        )


def _check_paths(config: TrainConfig) -> Path | None:
    """Every folder the run writes to, checked and created before any data is read (a bad
    path found after training would lose what the privacy was spent on); returns the
    checkpoint to resume from. See dpfit.outputs and dpfit.checkpoint.check_checkpoint_dir."""
    resume_path = None
    if config.checkpoint_dir:
        resume_path = ckpt.check_checkpoint_dir(config.checkpoint_dir, config.resume)
    if is_main_process():  # distributed: rank 0 writes
        if config.output:
            outputs.check_output_dir(config.output, config.resume)
        if config.checkpoint_dir:
            outputs.prepare_dir(config.checkpoint_dir, "--checkpoint-dir")
    return resume_path


def position_limit(model: torch.nn.Module) -> int | None:
    """Tokens the model can read: the size of its learned position table (RoBERTa's starts
    after its padding index); for models without one (rotary), the config's
    max_position_embeddings (SmolLM2: 8,192); else None (relative positions)."""
    limits = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in (
            "position_embeddings",
            "wpe",
            "embed_positions",
        ):
            offset = module.padding_idx + 1 if module.padding_idx is not None else 0
            limits.append(module.num_embeddings - offset)
    if limits:
        return min(limits)
    config = getattr(getattr(model, "backbone", model), "config", None)
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) else None


def _fit_max_length(
    model: torch.nn.Module, config: TrainConfig, given: bool, note: Callable[[str], None]
) -> TrainConfig:
    """An over-long max length fails only once a text is long enough (a shape error deep in
    the model, possibly after privacy was spent): a --max-length above the model's limit is
    refused here, naming it; the recipe's default is lowered to it (the limit is public)."""
    limit = position_limit(model)
    if limit is None or config.max_length <= limit:
        return config
    if given:
        raise DPFitError(
            f"--max-length {config.max_length} is more than {config.model or 'the model'} "
            f"can read ({limit} positions); use --max-length {limit} or less"
        )
    note(f"max length {config.max_length} lowered to the model's {limit} positions")
    return dataclasses.replace(config, max_length=limit)


def _fit_physical_batch(
    config: TrainConfig, recipe: Recipe, total_params: int, given: bool, note: Callable[[str], None]
) -> TrainConfig:
    """The recipe sizes physical batches for its own max length; a longer --max-length gets
    them resized to the same token budget (dpfit.recipe.physical_batch_for). Compute only:
    the logical batch and the accounting stay as they are."""
    if config.max_length == recipe.max_length or given:
        return config
    physical = min(physical_batch_for(total_params, config.max_length), config.batch_size)
    if physical == config.physical_batch_size:
        return config
    note(
        f"physical batch {physical} for max length {config.max_length} (the recipe's "
        f"{config.physical_batch_size} is for {recipe.max_length})"
    )
    return dataclasses.replace(config, physical_batch_size=physical)


def _check_phases(config: TrainConfig) -> None:
    if config.full_epochs and not 0 < config.full_epochs < config.epochs:
        raise DPFitError(
            f"--full-epochs must be between 1 and --epochs - 1 ({config.epochs - 1}), "
            f"got {config.full_epochs}"
        )


def _prepare_trainables(
    model,
    heads: tuple[str, ...],
    config: TrainConfig,
    biases_added: bool = False,
    head_only: bool = False,
):
    """Select what trains; returns a TrainableSummary."""
    import dpfit
    from dpfit.params import summarize

    if head_only:  # DP last layer: the head modules alone
        for name, p in model.named_parameters():
            p.requires_grad_(any(name == h or name.startswith(h + ".") for h in heads))
        return summarize(model)

    if config.add_biases and not biases_added:
        # on the backbone, so the saved record reloads with the backbone alone
        dpfit.add_biases(getattr(model, "backbone", model))
    if config.mode == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        return summarize(model)
    if config.mode in LORA_MODES:
        return _prepare_lora(model, heads, config)
    if count_bias_parameters(model, exclude=heads) == 0:
        raise NoTrainableParametersError(
            f"{config.model or 'the model'} has no bias terms outside its head, so bias-only "
            "training would train the head alone; add zero-initialised biases with --add-biases "
            "(dpfit.add_biases), or use --mode full"
        )
    return dpfit.make_bias_trainable(model, train_head=heads)


def _prepare_lora(model, heads: tuple[str, ...], config: TrainConfig):
    """--mode bias+lora / lora: peft LoRA adapters injected into the backbone (the head stays
    the task's), then the adapters (+ biases) + head made trainable."""
    import dpfit
    from dpfit.params import add_lora

    backbone = getattr(model, "backbone", model)
    add_lora(backbone, config.lora_r, config.lora_alpha, config.lora_targets)
    with_biases = config.mode == "bias+lora"
    if with_biases and count_bias_parameters(model, exclude=heads) == 0:
        raise NoTrainableParametersError(
            f"{config.model or 'the model'} has no bias terms outside its head; add "
            "zero-initialised biases with --add-biases, or use --mode lora"
        )
    return dpfit.make_lora_trainable(
        model, train_head=heads, biases=with_biases, freeze_a=config.lora_freeze_a
    )


def _merge_lora(model, config: TrainConfig) -> None:
    """Fold the LoRA adapters into the weights before the model is scored and saved: the
    same function, saved as the plain architecture (post-processing of the private steps)."""
    if config.mode in LORA_MODES:
        from dpfit.params import merge_lora

        merge_lora(getattr(model, "backbone", model))


def _enter_bias_phase(engine, optimizer, lr: float, note: Callable[[str], None]):
    """Second phase of X+BiTFiT: bias-only from here on, same ledger, rebuilt optimizer at
    the bias phase's rate (the full phase ran at full_lr)."""
    if engine.mode == "bias":
        return optimizer
    optimizer = engine.switch_phase("bias", optimizer)
    set_lr(optimizer, lr)
    note(
        f"phase switch: full -> bias after {engine.steps_taken} steps (eps {engine.epsilon():.3f})"
    )
    return optimizer


def _make_engine(
    model, config: TrainConfig, n: int, total_steps: int, delta: float, sigma: float | None
):
    import dpfit

    kwargs = dict(
        expected_batch_size=min(config.batch_size, n),
        sample_size=n,
        target_delta=delta,
        max_grad_norm=config.max_grad_norm,
        clipping=config.clipping,
        loss_reduction="mean",
        accountant=config.accountant,
        insecure_seed=_insecure_seed(config),
        neighbouring=config.neighbouring,
        privacy_unit="document" if config.privacy_unit == "document" else "example",
    )
    if config.full_epochs:  # two-phase X+BiTFiT: one accountant across both phases
        kwargs["schedule"] = [
            ("full", config.full_epochs),
            ("bias", config.epochs - config.full_epochs),
        ]
    else:
        kwargs["mode"] = config.mode
    if sigma is None:
        sigma = config.noise_multiplier
    if sigma is not None:
        kwargs["noise_multiplier"] = sigma
    else:
        kwargs["target_epsilon"] = config.epsilon
        kwargs["steps"] = total_steps
    return dpfit.PrivacyEngine(model, **kwargs)


# -- head-first: a private linear probe on frozen features, then biases + head -----------------


@torch.no_grad()
def frozen_features(model, items: Sequence[dict], collate, batch_size: int, device) -> torch.Tensor:
    """Pooled features of every training example: one backbone pass, without dropout."""
    was_training = model.training
    model.eval()
    out = []
    progress.report("head-first: features", 0, len(items))
    for start in range(0, len(items), batch_size):
        batch = collate(list(items[start : start + batch_size]))
        batch.pop("labels", None)
        batch.pop("position_ids", None)
        out.append(model.features(**{k: v.to(device) for k, v in batch.items()}).float().cpu())
        progress.report("head-first: features", min(start + batch_size, len(items)), len(items))
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0)


def _collate_features(items: list[tuple[torch.Tensor, int]]) -> dict:
    if not items:
        return {"x": torch.zeros(0), "y": torch.zeros(0, dtype=torch.long)}
    return {
        "x": torch.stack([x for x, _ in items]),
        "y": torch.tensor([y for _, y in items], dtype=torch.long),
    }


def _head_phase(
    model, items, collate, config: TrainConfig, n: int, delta: float, sigma: float, steps: int,
    device, note: Callable[[str], None],
    casts: FrozenWeightCasts,
    on_abort: Callable[[BaseException, object], None] | None = None,
) -> tuple[dict | None, object]:  # fmt: skip
    """Train the head alone on frozen features for `steps` logical steps; returns the
    engine state (ledger, generator) to carry into the main phase (None if non-private) and
    the (detached) engine, whose ledger is the run's record until the main engine holds it.
    `on_abort(error, engine)` keeps the record of head steps taken before an error. `casts`:
    the run's bf16 frozen-weight copies, which the main phase reuses."""
    import dpfit

    with casts.active(), autocast(config.precision, device):  # bf16 features, float32 out
        feats = frozen_features(model, items, collate, config.physical_batch_size, device)
    data = [(feats[i], int(items[i]["labels"])) for i in range(len(items))]
    note(f"head-first: features of {len(data)} examples computed once with the frozen backbone")
    head = model.head
    engine = None
    if config.non_private:
        loader = ShuffledBatches(data, config.batch_size, len(data), _collate_features, config.seed)
        stepper = PlainStepper(loader)
        params = list(head.parameters())
    else:
        engine = dpfit.PrivacyEngine(
            head,
            expected_batch_size=min(config.batch_size, n),
            sample_size=n,
            noise_multiplier=sigma,
            target_delta=delta,
            max_grad_norm=config.max_grad_norm,
            clipping=config.clipping,
            loss_reduction="mean",
            accountant=config.accountant,
            insecure_seed=_insecure_seed(config, offset=1_000_003),
            neighbouring=config.neighbouring,
        )
        params = engine.parameters()
    optimizer = OPTIMIZERS[config.optimizer](params, config.head_lr, config.weight_decay)
    if engine is not None:  # the optimizer first: an empty first batch steps at once
        loader = engine.data_loader(
            data, _collate_features, physical_batch_size=len(data), optimizer=optimizer
        )
        stepper = engine
    try:
        while stepper.steps_taken < steps:
            for batch in loader:
                x, y = batch["x"].to(device), batch["y"].to(device)
                loss = F.cross_entropy(head(x), y)
                loss.backward()
                if stepper.step(optimizer) and stepper.steps_taken >= steps:
                    break
    except BaseException as e:  # the head steps taken spent privacy: keep their record
        if engine is not None and engine.steps_taken and on_abort is not None:
            on_abort(e, engine)
        raise
    finally:
        if engine is not None:
            engine.detach()
    if engine is None:
        return None, None
    state = engine.state_dict()
    state.pop("loader", None)  # the main phase has a loader of its own
    note(f"head-first: {steps} private head steps, epsilon so far {engine.epsilon():.3f}")
    return state, engine


def _score_before(
    task, prep, model, config, device, note: Callable[[str], None], what: str
) -> dict:
    """The model before the (next) training phase, on the evaluation data (public): the
    starting checkpoint, or the linear probe alone before the biases train. Shows what
    training adds over it. Empty if the run has no evaluation data."""
    try:
        scores = task.evaluate(prep, model, config, device)
    except Exception:  # noqa: BLE001 - a diagnostic only; the final evaluation reports errors
        logger.exception("evaluating %s failed", what)
        return {}
    if "accuracy" in scores:
        note(f"accuracy of {what}: {scores['accuracy']:.4f}")
    return scores


def _dropout_for(config: TrainConfig, as_given: bool) -> float | str:
    """The dropout rate the model is built with: the flag's, else the recipe's. A model passed
    in ready-made, and image models (dpfit's have none), run with their own rates."""
    if as_given:
        if config.dropout not in (None, DROPOUT_MODEL):
            raise DPFitError(
                "--dropout sets a transformers text model's config before it is built; "
                + ("image models run with their own rates (dpfit's have no dropout)"
                   if config.task == "image-classification"
                   else "a model passed in is used as it is: set its rates before passing it")
            )  # fmt: skip
        return DROPOUT_MODEL
    if config.dropout is not None:
        return config.dropout
    return default_dropout(not config.non_private)


def _resolve_sigma(config: TrainConfig, q: float, steps: int, delta: float) -> float:
    """One noise multiplier for all the run's steps (head-first phase included)."""
    from dpfit.accounting import noise_multiplier_for

    if config.noise_multiplier is not None:
        return float(config.noise_multiplier)
    return noise_multiplier_for(
        config.epsilon, delta, q, steps, config.accountant, neighbouring=config.neighbouring
    )


# -- the run ---------------------------------------------------------------------------------


def _main_setup(
    model, config: TrainConfig, n: int, total_steps: int, delta: float, sigma: float | None,
    head_state: dict | None, items, collate, batch_size: int, head_steps: int,
):  # fmt: skip
    """The main phase's engine (carrying the head-first ledger), optimizer, loader and
    stepper: (engine or None when non-private, optimizer, loader, stepper, first lr)."""
    engine = None
    if config.non_private:
        loader = ShuffledBatches(
            items, batch_size, config.physical_batch_size, collate, config.seed
        )
        stepper = PlainStepper(loader)
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        engine = _make_engine(model, config, n, total_steps, delta, sigma)
        if head_state is not None:
            engine.load_state_dict(head_state)  # one ledger: the head steps are composed in
        params = list(engine.parameters())
    first_lr = config.full_lr if config.full_epochs and config.full_lr else config.lr
    optimizer = OPTIMIZERS[config.optimizer](params, first_lr, config.weight_decay)
    if engine is not None:  # the optimizer first: an empty first batch steps at once
        loader = engine.data_loader(
            items,
            collate_fn=collate,
            physical_batch_size=config.physical_batch_size,
            # distributed: every rank stops at the same logical step (the ledger counts the
            # head-first steps too)
            max_steps=head_steps + total_steps,
            optimizer=optimizer,
        )
        stepper = engine
    return engine, optimizer, loader, stepper, first_lr


def train(
    config: TrainConfig,
    on_step: Callable[[StepRow, int], None] | None = None,
    on_note: Callable[[str], None] | None = None,
    *,
    prepared: Prepared | None = None,
    task: Task | None = None,
    set_by: str = "flags",
) -> TrainResult:
    """Run one training job as configured; see module docstring.

    Args:
        on_step: called after every logical step with (row, total logical steps).
        on_note: called with human-readable notes (recipe, subsampling, split, resume).
        prepared, task: a task and its already built model and data (Python callers that
            hold a model object); by default the task named in `config` prepares them.
        set_by: who set the recipe fields `config` sets, for the recipe note (a program
            such as ``dpfit pretrain`` fills them from its own rule, not from flags).
    """
    t_start = time.perf_counter()
    notes: list[str] = []

    def note(msg: str) -> None:
        notes.append(msg)
        logger.info(msg)
        if on_note is not None:
            on_note(msg)

    _check_options(config)
    resume_path = _check_paths(config)
    if config.insecure_reproducible_noise and not config.non_private:
        msg = (
            f"WARNING: --insecure-reproducible-noise: the DP noise and the Poisson sampling are "
            f"seeded from --seed {config.seed}. Anyone who knows the seed can regenerate every "
            "noise vector and batch, so the run is NOT private against them (metrics.json "
            'records "insecure_seed": true). Use it only to debug or reproduce a run.'
        )
        logger.warning(msg)
        note(msg)
    device = _device(config.device)
    _seed_everything(config.seed)
    task = task if task is not None else get_task(config.task)
    images = config.task == "image-classification"  # no token length
    dropout = _dropout_for(config, images or prepared is not None)
    prep = (
        prepared
        if prepared is not None
        else task.prepare(dataclasses.replace(config, dropout=dropout))
    )
    for n_ in prep.notes:
        note(n_)
    model = prep.model
    freeze_a = (
        config.lora_freeze_a
        if config.lora_freeze_a is not None
        else default_lora_freeze_a(
            not config.non_private, config.mode, language_model=prep.num_classes == 0
        )
    )
    summary = _prepare_trainables(
        model, prep.head_names, dataclasses.replace(config, lora_freeze_a=freeze_a),
        prep.biases_added, prep.head_only,
    )  # fmt: skip

    # the recipe: a function of public quantities only; each flag overrides its field
    n = prep.n
    delta = config.delta if config.delta is not None else default_delta(n)
    head_first = config.head_first
    if head_first is None and (
        config.full_epochs or not hasattr(model, "features") or prep.privacy_unit == "document"
    ):
        # a schedule of its own, a model without a pooled head, or documents of windows (the
        # probe's examples are single windows)
        head_first = False
    recipe = resolve_recipe(
        n, prep.num_classes, config.epsilon, delta, summary.total, config.mode,
        private=not config.non_private, head_first=head_first, full_epochs=config.full_epochs,
        start="trained" if prep.starts_trained else "pretrained", tokens=not images,
    )  # fmt: skip
    recipe = dataclasses.replace(
        recipe,
        dropout=dropout if config.dropout is None else recipe.dropout,
        lora_freeze_a=freeze_a,  # False outside the LoRA modes (True is refused there)
    )
    overrides = config.overrides()
    config = config.with_recipe(recipe)  # dropout: the rate the model was built with
    _check_phases(config)
    if not images:  # image models have no token positions
        config = _fit_max_length(model, config, "max_length" in overrides, note)
        config = _fit_physical_batch(
            config, recipe, summary.total, "physical_batch_size" in overrides, note
        )
    if config.activation_checkpointing:
        from dpfit.activation_checkpointing import enable_activation_checkpointing

        enable_activation_checkpointing(model, config.mode)
        note("activation checkpointing: layer activations recomputed in the backward pass")
        if getattr(task, "chunked_head", None) is False:  # a task that can chunk its head
            task = dataclasses.replace(task, chunked_head=True)
            note("chunked loss: the output head's logits computed and recomputed in chunks")
    described = recipe.describe()
    note(
        f"recipe (from n={n}, {f'{prep.num_classes} classes' if prep.num_classes else 'causal LM'}, "
        f"epsilon {config.epsilon}, delta "
        f"{delta:.3g}, {summary.total:,} parameters): {described}"
        + (f"; overridden by {set_by}: {', '.join(overrides)}" if overrides else "")
    )
    model.to(device)
    model.train()
    if config.precision != "fp32":  # resolved once; metrics.json records what ran
        config = dataclasses.replace(config, precision=resolve_precision(config.precision, device))
        note(f"compute precision: {config.precision} (forward and backward; float32 masters)")
    text_classifier = config.task == "classification"  # the task the kernels were timed on
    if text_classifier and choose_attention(model, device, config.max_length, config.precision):
        note(f"attention: eager (faster than SDPA on CPU in bf16, up to {EAGER_MAX_LENGTH} tokens)")

    items = task.items(prep, config.max_length)
    if len(items) != n:
        raise DPFitError(f"the task encoded {len(items)} of {n} training examples")
    full_phase = not config.non_private and (config.mode == "full" or config.full_epochs > 0)
    backbone = getattr(model, "backbone", model)
    collate = task.collate(
        prep,
        position_ids=full_phase
        and "position_ids" in inspect.signature(backbone.forward).parameters,
    )
    batch_size = min(config.batch_size, n)
    steps_per_epoch = (
        math.ceil(n / batch_size) if config.non_private else max(1, round(n / batch_size))
    )
    total_steps = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    head_steps = config.head_epochs * steps_per_epoch

    rows: list[StepRow] = []
    epoch = 0
    elapsed_before = 0.0
    wall_before = 0.0  # wall time of the run's earlier processes (a resumed run)

    engine = None
    sigma = None
    head_state = None
    head_scores: dict = {}
    head_epsilon = None  # spent by the head-first phase (its share of the budget)
    start_scores: dict = {}
    if prep.starts_trained:  # on resume too: the model is still the one loaded
        start_scores = _score_before(
            task, prep, model, config, device, note, "the starting model, before training"
        )
    t_loop = time.perf_counter()
    # bf16 copies of the frozen weights, made once for the run: head-first features and steps
    frozen_casts = FrozenWeightCasts(model, config.precision, device)
    if head_steps and not config.non_private:
        sigma = _resolve_sigma(config, batch_size / n, head_steps + total_steps, delta)
    head_engine = None  # the head-first phase's, while its ledger is the run's record
    continuation: ckpt.Continuation | None = None
    first_step = 0

    def aborted(error: BaseException, spent) -> None:
        """The steps taken spent privacy: keep their record (and release what may be)."""
        if spent is not None and spent.steps_taken and config.output and is_main_process():
            _save_partial(error, config, task, prep, model, spent, note, first_step, continuation)

    if head_steps and resume_path is None:
        with _oom_guard(config):
            head_state, head_engine = _head_phase(  # (None, None) when non-private
                model, items, collate, config, n, delta, sigma or 0.0, head_steps, device, note,
                on_abort=aborted, casts=frozen_casts,
            )  # fmt: skip
    try:  # from the head-first steps on, an error or Ctrl-C keeps the record of what was spent
        engine, optimizer, loader, stepper, first_lr = _main_setup(
            model, config, n, total_steps, delta, sigma, head_state, items, collate, batch_size,
            head_steps,
        )  # fmt: skip
    except BaseException as e:
        aborted(e, head_engine)
        raise
    if engine is not None and head_state is not None:
        head_epsilon = engine.epsilon()  # one ledger: the head steps are composed in
    first_step = stepper.steps_taken  # head-first steps already on the ledger

    if resume_path is not None:
        state = ckpt.load_checkpoint(resume_path)
        # fields older checkpoints lack, as those runs had them: the model's own dropout, and
        # every LoRA matrix trained
        saved = {"dropout": DROPOUT_MODEL, "lora_freeze_a": False, **state["config"]}
        ckpt.check_compatible(saved, config.fingerprint(), tuple(config.fingerprint()))
        ckpt.load_trainable_state(model, state["trainable"])
        if engine is not None and config.full_epochs and int(state["epoch"]) >= config.full_epochs:
            optimizer = _enter_bias_phase(engine, optimizer, config.lr, note)
        optimizer.load_state_dict(state["optimizer"])
        stepper.load_state_dict(state["stepper"])
        loader.load_state_dict(state["loader"])
        ckpt.set_rng_state(state["rng"])
        rows = [StepRow(**r) for r in state["rows"]]
        epoch = int(state["epoch"])
        elapsed_before = float(state["elapsed_s"])
        first_step = int(state.get("first_step", 0))
        wall_before = float(state.get("wall_s", 0.0))
        head_scores = dict(state.get("head_scores") or {})  # the probe's row survives resume
        head_epsilon = state.get("head_epsilon")
        note(f"resumed from {resume_path.name}: logical step {len(rows)}, epoch {epoch + 1}")
        if engine is not None and len(rows) < total_steps and is_main_process():
            # fresh noise and batches from here on: a second continuation is a fork
            found = ckpt.list_checkpoints(config.checkpoint_dir)
            continuation = ckpt.claim_continuation(
                resume_path, engine.steps_taken, config.allow_fork,
                at=len(rows), reach=ckpt.reach(config.checkpoint_dir, found),
            )  # fmt: skip
            if continuation.fork:
                note(
                    f"--fork: continuation {continuation.number} of {resume_path.name}; "
                    "releasing the outputs of several continuations costs the shared steps "
                    "plus each continuation's own steps (metrics.json: continuation)"
                )

    def save(epoch_now: int) -> None:
        if not config.checkpoint_dir or not is_main_process():  # distributed: rank 0 writes
            return
        ckpt.save_checkpoint(
            config.checkpoint_dir,
            len(rows),  # logical steps of the main phase, as steps.csv counts them
            {
                "config": config.fingerprint(),
                "trainable": ckpt.trainable_state(model, everything=config.full_epochs > 0),
                "optimizer": optimizer.state_dict(),
                "stepper": stepper.state_dict(),
                "loader": loader.state_dict(),
                "rng": ckpt.rng_state(),
                "rows": [dataclasses.asdict(r) for r in rows],
                "epoch": epoch_now,
                "elapsed_s": elapsed_before + time.perf_counter() - t_loop,
                "first_step": first_step,
                "wall_s": wall_before + time.perf_counter() - t_start,
                "head_scores": head_scores,
                "head_epsilon": head_epsilon,
            },
        )

    if head_steps and resume_path is None:
        try:  # the head-first phase's ledger and head: a kill from here on can --resume
            save(0)
            head_scores = _score_before(
                task, prep, model, config, device, note, "head-first: the linear probe alone"
            )
            save(0)  # with the probe's score, which a resumed run reports
        except BaseException as e:
            aborted(e, engine or head_engine)
            raise

    acc_loss, acc_n = 0.0, 0

    def record(epoch_now: int) -> None:
        # Private runs keep no per-step loss or batch size: both are exact functions of the
        # private batch (see dpfit.reporting.PRIVATE_STEP_FIELDS).
        # Nor its duration, and each row's epsilon is the one after its own step: a noise-only
        # step is recorded with the next one, and must not look like it.
        nonlocal acc_loss, acc_n
        while len(rows) < stepper.steps_taken - first_step:
            current = len(rows) == stepper.steps_taken - first_step - 1
            loss = acc_loss / acc_n if (config.non_private and current and acc_n) else None
            done = first_step + len(rows) + 1  # ledger steps after this row's step
            elapsed = elapsed_before + time.perf_counter() - t_loop
            rows.append(
                StepRow(
                    step=len(rows) + 1,
                    epoch=epoch_now + 1,
                    epsilon=math.inf if engine is None else engine.epsilon(steps=done),
                    elapsed_s=elapsed if config.non_private else None,
                    loss=loss,
                )
            )
            if on_step is not None:
                on_step(rows[-1], total_steps)
        acc_loss, acc_n = 0.0, 0

    stopped = len(rows) >= total_steps
    try:
        while epoch < config.epochs and not stopped:
            if engine is not None and config.full_epochs and epoch >= config.full_epochs:
                optimizer = _enter_bias_phase(engine, optimizer, config.lr, note)
            for batch in loader:
                weight = batch.pop("_weight", 1.0)
                batch = {k: v.to(device) for k, v in batch.items()}
                with _oom_guard(config), frozen_casts.active():  # bf16 frozen weights
                    with autocast(config.precision, device):  # float32 masters, norms, noise
                        loss = task.loss(model, batch)
                    (loss * weight).backward()
                if config.non_private:
                    bsz = int(next(iter(batch.values())).shape[0])
                    acc_loss += float(loss.detach()) * bsz
                    acc_n += bsz
                if config.lr_schedule != "constant":  # this logical step's rate
                    base = first_lr if engine is not None and engine.mode == "full" else config.lr
                    set_lr(optimizer, base * lr_factor(config.lr_schedule, len(rows), total_steps))
                if stepper.step(optimizer):
                    # empty Poisson batches are noise-only steps the engine takes on its own
                    record(epoch)
                    if len(rows) % config.checkpoint_every == 0 or len(rows) >= total_steps:
                        save(epoch)
                    if len(rows) >= total_steps:
                        stopped = True
                        break
            else:
                epoch += 1
                record(epoch - 1)  # trailing empty batches of the pass, if any
                if len(rows) >= total_steps:
                    stopped = True
    except BudgetExhaustedError as e:
        note(f"stopped early: {e}")
    except BaseException as e:  # the steps taken spent privacy: keep their record and model
        aborted(e, engine)
        raise
    train_time = elapsed_before + time.perf_counter() - t_loop
    if engine is not None and config.checkpoint_dir and is_main_process():
        # the outputs release this state: checkpoint it first (so --resume continues exactly
        # what was released), claim the older checkpoints and log the release
        found = ckpt.list_checkpoints(config.checkpoint_dir)
        if not found or found[-1][0] != len(rows):
            save(epoch)
        _claim_release(config.checkpoint_dir, len(rows), "the run's outputs")

    # From here on the privacy is spent: nothing may be lost to an error (metrics.json first).
    privacy = None
    if engine is not None:
        privacy = dict(engine.privacy_record())
        privacy["insecure_seed"] = bool(config.insecure_reproducible_noise)
        if continuation is not None:
            privacy["continuation"] = ckpt.fork_report(
                continuation, engine.ledger.records, engine.target_delta, engine.ledger.accountant
            )
        engine.detach()
    _merge_lora(model, config)
    errors: list[str] = []
    try:
        scores = task.evaluate(prep, model, config, device)
    except Exception as e:  # noqa: BLE001 - reported in metrics.json, re-raised below
        logger.exception("evaluation failed after training")
        scores = {}
        errors.append(f"evaluation: {type(e).__name__}: {e}")
    metrics = _metrics(
        config, recipe, overrides, summary, scores, privacy, rows, train_time, t_start, device,
        head_steps, delta,
    )  # fmt: skip
    metrics["wall_time_s"] += wall_before  # the whole run's, as train_time_s is
    if privacy is not None:  # what one sampled and clipped contribution is
        metrics["privacy_unit"] = prep.privacy_unit
    if privacy is not None:
        metrics["epsilon_by_phase"] = _epsilon_by_phase(config, rows, head_steps, head_epsilon)
    if "accuracy" in head_scores:
        metrics["head_first_accuracy"] = head_scores["accuracy"]
    if "accuracy" in start_scores:
        metrics["start_accuracy"] = start_scores["accuracy"]
        if "accuracy" in scores and scores["accuracy"] < start_scores["accuracy"]:
            note(
                f"training lowered accuracy on the evaluation data from "
                f"{start_scores['accuracy']:.4f} (the starting model) to {scores['accuracy']:.4f}: "
                "the starting model is the better one here"
            )
    if privacy and "continuation" in privacy:
        metrics["continuation"] = privacy["continuation"]
    result = TrainResult(metrics, rows, model, prep.tokenizer, privacy, notes)
    if config.output and is_main_process():  # distributed: rank 0 writes
        result.output_dir = save_outputs(result, config, task, prep, errors)
    elif errors:
        raise OutputError("; ".join(errors))
    return result


def _epsilon_by_phase(
    config: TrainConfig, rows: list[StepRow], head_steps: int, head_epsilon: float | None
) -> list[dict]:
    """Epsilon spent by the end of each phase, in order (the last is the run's): shows how
    much of the budget the head-first or full phase took, which the plot marks."""
    phases = []
    if head_steps and head_epsilon is not None:
        phases.append({"phase": "head-first", "steps": head_steps, "epsilon_after": head_epsilon})
    main = [("main", rows)]
    if config.full_epochs:
        full = [r for r in rows if r.epoch <= config.full_epochs]
        main = [("full", full), ("bias", rows[len(full) :])]
    for name, part in main:
        if part:
            phases.append({"phase": name, "steps": len(part), "epsilon_after": part[-1].epsilon})
    return phases


def _claim_release(directory: str | Path, step: int, what: str) -> None:
    """One rule wherever a model leaves the process: every older checkpoint of the run is
    claimed as continued (a later resume of one is a fork), and the release is logged (a
    fork's report counts how far the run got)."""
    ckpt.claim_superseded(ckpt.list_checkpoints(directory), step, f"released: {what}")
    ckpt.record_release(directory, step, what)


def _released_state(config: TrainConfig, model, engine, first_step: int) -> int:
    """Put the state to release into `model` and `engine`; return how many of the steps
    taken it leaves out.

    A run that checkpoints releases its newest checkpoint: the live state may be partway
    through a step (a Ctrl-C in the progress callback or in a save), and a model released
    past the checkpoint that --resume continues would share its steps with the resumed run,
    an unaccounted fork. Steps after the checkpoint leave the process in no form (their
    epsilon was shown, a public function of the step count), and --resume redraws them.
    """
    found = ckpt.list_checkpoints(config.checkpoint_dir) if config.checkpoint_dir else []
    if not found:
        return 0
    state = ckpt.load_checkpoint(found[-1][1])
    taken = engine.steps_taken
    if sum(int(r["count"]) for r in state["stepper"]["ledger"]["records"]) == taken:
        return 0
    ckpt.load_trainable_state(model, state["trainable"])
    engine.load_state_dict(state["stepper"])
    return taken - engine.steps_taken


def _save_partial(
    error: BaseException, config: TrainConfig, task: Task, prep: Prepared, model, engine,
    note: Callable[[str], None], first_step: int,
    continuation: ckpt.Continuation | None = None,
) -> None:  # fmt: skip
    """A run stopped by an error or Ctrl-C after spending privacy: OUTPUT/metrics.json with
    what was spent (status "failed" or "interrupted") and the model so far (a noised model
    is post-processing of the steps taken; with checkpoints, the newest one's, see
    _released_state). Best effort: the original error wins."""
    out = Path(config.output)
    status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
    releasable = True
    discarded = 0
    try:
        discarded = _released_state(config, model, engine, first_step)
        if config.checkpoint_dir:
            what = f"the {status} run's model so far"
            _claim_release(config.checkpoint_dir, engine.steps_taken - first_step, what)
    except Exception:  # noqa: BLE001 - then the record of what was spent, and no model
        logger.exception("could not settle the state to release: %s gets no model", out)
        releasable = False
    steps = engine.steps_taken - first_step
    privacy = dict(engine.privacy_record())
    privacy["insecure_seed"] = bool(config.insecure_reproducible_noise)
    if continuation is not None:
        privacy["continuation"] = ckpt.fork_report(
            continuation, engine.ledger.records, engine.target_delta, engine.ledger.accountant
        )
    record = {
        "status": status,
        # the type only: a message may quote shapes or values of the private batch (it is
        # raised to the caller, who sees it; metrics.json is declared public)
        "error": type(error).__name__,
        "task": config.task,
        "private": True,
        "epsilon": privacy["epsilon"],
        "delta": privacy["delta"],
        "steps": steps,
        # taken after the newest checkpoint and released in no form (--resume redraws them)
        "steps_discarded": discarded,
        "insecure_seed": privacy["insecure_seed"],
        "privacy": privacy,
        "config": dataclasses.asdict(config),
    }
    if "continuation" in privacy:
        record["continuation"] = privacy["continuation"]
    try:
        write_json(out / "metrics.json", record)
        if not releasable:
            return
        _merge_lora(model, config)
        task.save(prep, model, out / "model")
        window = {}  # long texts: how they were cut, so `dpfit evaluate` cuts them alike
        if prep.state.get("stride") is not None:
            window = {"window_length": prep.state["length"], "stride": prep.state["stride"]}
        write_json(
            out / "model" / "dpfit.json",
            {"private": True, "status": status, **privacy, **window},
        )
    except Exception:  # noqa: BLE001 - the error that stopped training is the one to raise
        logger.exception("could not write the record of the %s run to %s", status, out)
        return
    kept = f" (the newest checkpoint's; {discarded} later step(s) discarded)" if discarded else ""
    note(
        f"{status} after {steps} steps, epsilon {privacy['epsilon']:.4g} spent: {out} holds "
        f"its metrics.json and the model so far{kept}"
        + ("; rerun with --resume to continue" if config.checkpoint_dir else "")
    )


def _metrics(
    config, recipe, overrides, summary, scores, privacy, rows, train_time, t_start, device,
    head_steps, delta,
) -> dict:  # fmt: skip
    private = not config.non_private
    m = {
        "task": config.task,
        **scores,
        "private": private,
        "epsilon": privacy["epsilon"] if privacy else math.inf,
        "delta": privacy["delta"] if privacy else None,
        # "epsilon" is for this relation; both relations' epsilons (docs/threat-model.md)
        "neighbouring": privacy["neighbouring"] if privacy else None,
        "epsilon_add_remove": privacy["epsilon_add_remove"] if privacy else math.inf,
        "epsilon_replace_one": privacy["epsilon_replace_one"] if privacy else math.inf,
        "noise_multiplier": privacy["noise_multiplier"] if privacy else None,
        "sample_rate": privacy["sample_rate"] if privacy else None,
        "max_grad_norm": config.max_grad_norm if private else None,
        "clipping": config.clipping if private else None,
        "steps": len(rows),
        "head_first_steps": head_steps,
        "epochs": config.epochs,
        "batch_size": config.batch_size,
        "lr": config.lr,
        "full_lr": config.full_lr if config.full_epochs else None,
        "lr_schedule": config.lr_schedule,
        # images have no token length: the recipe's value is not what ran
        "max_length": None if config.task == "image-classification" else config.max_length,
        "trainable_params": summary.trainable,
        "total_params": summary.total,
        "trainable_fraction": summary.fraction,
        "mode": config.mode,
        "recipe": recipe.as_dict(),
        "overridden_by_flags": list(overrides),
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - t_start,
        "peak_memory_mb": peak_memory_mb(device.type),
        "final_train_loss": (
            None  # a private run's training loss is not released
            if private
            else next((r.loss for r in reversed(rows) if r.loss is not None), None)
        ),
        "insecure_seed": bool(private and config.insecure_reproducible_noise),
        "config": dataclasses.asdict(config),
    }
    if private and privacy is None:  # pragma: no cover - defensive
        m["delta"] = delta
    return m


def save_outputs(
    result: TrainResult, config: TrainConfig, task: Task, prep: Prepared, errors: list[str]
) -> Path:
    """DIR/metrics.json first (the record of what was spent), then steps.csv, the plot and
    DIR/model (+ dpfit.json). A write that fails for a path reason (OSError: folder removed,
    disk full, permissions) is retried in a fallback folder (dpfit.outputs.fallback_dir);
    every error is recorded in metrics.json and raised as one OutputError line that says
    where each output is, after the rest are written."""
    out = Path(config.output)
    rescue: Path | None = None
    places: dict[str, Path] = {}

    def attempt(what: str, write: Callable[[Path], None]) -> None:
        nonlocal rescue
        try:
            write(out)
            places[what] = out
            return
        except Exception as e:  # noqa: BLE001 - recorded, re-raised as OutputError below
            logger.exception("writing %s to %s failed", what, out)
            errors.append(f"{what}: {type(e).__name__}: {e}")
            if not isinstance(e, OSError):
                return  # not the folder's fault: another folder would fail the same way
        if rescue is None:
            rescue = outputs.fallback_dir(config.output, config.task)
        try:
            write(rescue)
            places[what] = rescue
        except Exception as e:  # noqa: BLE001
            errors.append(f"{what} (fallback {rescue}): {type(e).__name__}: {e}")

    def metrics(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / "metrics.json", result.metrics)

    def steps(folder: Path) -> None:
        write_steps_csv(folder / "steps.csv", result.steps, private=not config.non_private)
        plot_steps(result.steps, folder, result.metrics.get("epsilon_by_phase", ()))

    def model(folder: Path) -> None:
        task.save(prep, result.model, folder / "model")
        write_json(folder / "model" / "dpfit.json", _privacy_file(result))

    attempt("metrics.json", metrics)
    attempt("steps.csv/plots", steps)
    attempt("model", model)
    if errors:
        result.metrics["output_errors"] = list(errors)
        if "metrics.json" in places:
            write_json(places["metrics.json"] / "metrics.json", result.metrics)
        where = "; ".join(f"{k} in {v}" for k, v in places.items()) or "nothing was written"
        spent = result.metrics.get("epsilon")
        head = (
            f"training finished (epsilon {spent:.4g} spent) but some outputs failed"
            if isinstance(spent, float) and math.isfinite(spent)
            else "training finished but some outputs failed"
        )
        kept = " (metrics.json there records what was spent)" if "metrics.json" in places else ""
        msg = f"{head}: {'; '.join(errors)}. Written: {where}{kept}"
        raise OutputError(" ".join(msg.split()))  # one line, whatever the errors held
    return out


def _privacy_file(result: TrainResult) -> dict:
    m = result.metrics
    record = {"private": result.privacy is not None, **(result.privacy or {})}
    record.setdefault("trainable_fraction", m.get("trainable_fraction"))
    record.setdefault("steps", m.get("steps"))
    record["mode"] = m.get("mode")
    record["insecure_seed"] = m.get("insecure_seed", False)
    if m.get("window_length") is not None:  # long texts: `dpfit evaluate` cuts them alike
        record.update(window_length=m["window_length"], stride=m["stride"])
    config = m.get("config") or {}
    if config.get("task") == "classification" and config.get("data") is None:
        # `dpfit evaluate --model DIR/model` without --data scores the same held-out movies
        record["bundled_split_seed"] = config.get("seed", 0)
    return record


def save_model(
    model, tokenizer, folder: str | Path, privacy: dict | None, metrics: dict | None = None
) -> None:
    """A classifier folder (see dpfit.tasks.pooling) plus dpfit.json with the privacy record."""
    from dpfit.tasks.pooling import PooledClassifier, save_pooled_classifier

    folder = Path(folder)
    if isinstance(model, PooledClassifier):
        save_pooled_classifier(model, tokenizer, folder)
    else:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    result = TrainResult(metrics or {}, [], model, tokenizer, privacy)
    write_json(folder / "dpfit.json", _privacy_file(result))

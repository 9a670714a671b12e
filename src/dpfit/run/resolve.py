"""Stage 1, resolve: options checked and paths created before any data is read, the recipe's
numbers fitted to the model (max length, physical batch), the noise multiplier."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from pathlib import Path

import torch

from dpfit import checkpoint as ckpt
from dpfit import outputs
from dpfit.distributed import is_main_process
from dpfit.dropout import MODEL as DROPOUT_MODEL
from dpfit.errors import DPFitError
from dpfit.models import position_limit
from dpfit.recipe import Recipe, default_dropout, physical_batch_for
from dpfit.run.config import WINDOWED_TASKS, TrainConfig
from dpfit.windows import GROUPED_UNITS, check_stride

logger = logging.getLogger(__name__)


def device_for(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def insecure_seed(config: TrainConfig, offset: int = 0) -> int | None:
    """--seed is public: noise and sampling use OS randomness unless the user opts out."""
    if not config.insecure_reproducible_noise:
        return None
    return config.seed + offset


def check_options(config: TrainConfig) -> None:
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
    check_user_options(config)
    if config.task not in WINDOWED_TASKS and (config.privacy_unit != "window" or config.stride):
        raise DPFitError(
            "--privacy-unit document and --stride cut long texts into token windows, for --task "
            f"{' or '.join(WINDOWED_TASKS)} only; drop them for --task {config.task}"
        )
    if config.stride is not None and config.max_length is not None:
        check_stride(config.stride, config.max_length)
    unit = config.privacy_unit
    if unit in GROUPED_UNITS:  # a document's windows, or a user's rows, clipped as one
        row, plain = ("window", "--privacy-unit window") if unit == "document" else (
            "row", "no --privacy-unit (each row one example)"
        )  # fmt: skip
        if config.non_private:
            raise DPFitError(
                f"--privacy-unit {unit} is what a private run's epsilon protects; a "
                f"--non-private run has none: use {plain}"
            )
        if config.head_first or config.head_epochs:
            raise DPFitError(
                f"--head-first / --head-epochs train the head on each {row}'s features as one "
                f"example, which --privacy-unit {unit} does not allow; drop them (the {unit} "
                f"unit trains without the head-first phase) or use {plain}"
            )
        if config.mode != "bias" or config.full_epochs:
            raise DPFitError(
                f"--privacy-unit {unit} sums a {unit}'s per-example bias gradients before the "
                f"clip: --mode bias only (without --full-epochs); use {plain}"
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


def check_user_options(config: TrainConfig) -> None:
    """--privacy-unit user and its flags: each needs the others, and a file whose rows say
    whose they are (refused before any data is read, saying what to add or drop)."""
    if config.privacy_unit != "user":
        for given, flag in (
            (config.user_column is not None, "--user-column"),
            (config.max_rows_per_user is not None, "--max-rows-per-user"),
        ):
            if given:
                raise DPFitError(
                    f"{flag} is for --privacy-unit user (epsilon protects everything one user "
                    f"contributed); add --privacy-unit user, or drop {flag}"
                )
        return
    if config.task not in WINDOWED_TASKS:
        raise DPFitError(
            f"--privacy-unit user is for --task {' or '.join(WINDOWED_TASKS)}; for --task "
            f"{config.task} drop it"
        )
    if not config.user_column:
        raise DPFitError(
            "--privacy-unit user needs --user-column COL, the column of your --data file that "
            "says whose each row is (all of one user's rows are then protected together)"
        )
    if config.data is None:
        raise DPFitError(
            "--privacy-unit user needs your own --data file with a user column: the bundled "
            "data has no users"
        )


def check_paths(config: TrainConfig) -> Path | None:
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


def fit_max_length(
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


def fit_physical_batch(
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


def check_phases(config: TrainConfig) -> None:
    if config.full_epochs and not 0 < config.full_epochs < config.epochs:
        raise DPFitError(
            f"--full-epochs must be between 1 and --epochs - 1 ({config.epochs - 1}), "
            f"got {config.full_epochs}"
        )


def dropout_for(config: TrainConfig, as_given: bool) -> float | str:
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


def resolve_sigma(config: TrainConfig, q: float, steps: int, delta: float) -> float:
    """One noise multiplier for all the run's steps (head-first phase included)."""
    from dpfit.accounting import noise_multiplier_for

    if config.noise_multiplier is not None:
        return float(config.noise_multiplier)
    return noise_multiplier_for(
        config.epsilon, delta, q, steps, config.accountant, neighbouring=config.neighbouring
    )

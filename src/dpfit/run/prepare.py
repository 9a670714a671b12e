"""Stage 2, prepare: data and model through the task plug-in, what trains, and the recipe.

The recipe is a function of public quantities only (dataset size, classes, epsilon, model
size); each flag overrides its field, and the run's config is the recipe-filled one.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dpfit.attention import EAGER_MAX_LENGTH, choose_attention
from dpfit.errors import DPFitError
from dpfit.frozen_casts import FrozenWeightCasts
from dpfit.precision import resolve_precision
from dpfit.recipe import Recipe, default_delta, default_lora_freeze_a, resolve_recipe
from dpfit.run.config import TrainConfig
from dpfit.run.resolve import check_phases, dropout_for, fit_max_length, fit_physical_batch
from dpfit.run.trainables import prepare_trainables
from dpfit.tasks import Prepared, Task
from dpfit.windows import GROUPED_UNITS


@dataclass(frozen=True)
class Setup:
    """Everything the private phases need, fixed before the first step."""

    config: TrainConfig  # recipe-filled
    recipe: Recipe
    overrides: tuple[str, ...]  # the recipe fields set by flags
    summary: object  # dpfit.params.TrainableSummary
    task: Task
    prep: Prepared
    delta: float
    device: torch.device
    items: list
    collate: Callable[[list], dict]
    batch_size: int
    total_steps: int  # of the main phase
    head_steps: int
    frozen_casts: FrozenWeightCasts | None = None

    @property
    def model(self) -> torch.nn.Module:
        return self.prep.model

    @property
    def n(self) -> int:
        return self.prep.n


def prepare(
    config: TrainConfig, task: Task, prepared: Prepared | None, device: torch.device,
    note: Callable[[str], None], set_by: str,
) -> Setup:  # fmt: skip
    """Read the data and build the model (or take `prepared`), choose what trains, resolve
    the recipe and fit it to the model and device."""
    images = config.task == "image-classification"  # no token length
    dropout = dropout_for(config, images or prepared is not None)
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
    summary = prepare_trainables(
        model, prep.head_names, dataclasses.replace(config, lora_freeze_a=freeze_a),
        prep.biases_added, prep.head_only,
    )  # fmt: skip

    n = prep.n
    delta = config.delta if config.delta is not None else default_delta(n)
    head_first = config.head_first
    if head_first is None and (
        config.full_epochs or not hasattr(model, "features") or prep.privacy_unit in GROUPED_UNITS
    ):
        # a schedule of its own, a model without a pooled head, or documents of windows or
        # users of rows (the probe's examples are single windows or rows)
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
    check_phases(config)
    if not images:  # image models have no token positions
        config = fit_max_length(model, config, "max_length" in overrides, note)
        config = fit_physical_batch(
            config, recipe, summary.total, "physical_batch_size" in overrides, note
        )
    if config.activation_checkpointing:
        from dpfit.activation_checkpointing import enable_activation_checkpointing

        enable_activation_checkpointing(model, config.mode)
        note("activation checkpointing: layer activations recomputed in the backward pass")
        if getattr(task, "chunked_head", None) is False:  # a task that can chunk its head
            task = dataclasses.replace(task, chunked_head=True)
            note("chunked loss: the output head's logits computed and recomputed in chunks")
    what = f"{prep.num_classes} classes" if prep.num_classes else "causal LM"
    note(
        f"recipe (from n={n}, {what}, epsilon {config.epsilon}, delta {delta:.3g}, "
        f"{summary.total:,} parameters): {recipe.describe()}"
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
    return Setup(
        config, recipe, overrides, summary, task, prep, delta, device, items, collate,
        batch_size, total_steps, head_steps,
    )  # fmt: skip

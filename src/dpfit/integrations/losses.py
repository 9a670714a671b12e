"""Per-example losses for transformers task heads, registered by task.

Why: DP-SGD clips each example's gradient, so the batch loss must be (1/n) sum_i l_i with l_i a
function of example i alone. A model's own loss is not always that: causal-LM and
token-classification heads average over every token in the batch, which weights example i by
its share of the batch's tokens, so its gradient (and the clipped row) changes with its
neighbours' lengths. Here each example's loss is the mean over its own tokens; the batch loss
is the mean over examples.

A model is matched by the classes in its MRO against transformers' auto-model tables (so
``GPT2LMHeadModel`` is a causal LM), after any classes registered with
:func:`register_per_example_loss`. A model with no match is refused: its loss cannot be
assumed to decompose per example.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dpfit.errors import LossReductionError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LossInputs:
    """What a per-example loss sees: the head's logits, the batch's labels, the model config."""

    logits: torch.Tensor
    labels: torch.Tensor
    config: Any  # the model's PretrainedConfig (problem_type, num_labels)
    label_smoothing: float = 0.0


PerExampleLoss = Callable[[LossInputs], torch.Tensor]  # -> shape (batch,)

_TASK_LOSSES: dict[str, PerExampleLoss] = {}
_USER_CLASSES: dict[str, PerExampleLoss] = {}  # model class name -> loss


def _task(name: str) -> Callable[[PerExampleLoss], PerExampleLoss]:
    def deco(fn: PerExampleLoss) -> PerExampleLoss:
        _TASK_LOSSES[name] = fn
        return fn

    return deco


def _mean_over_own_tokens(logits: torch.Tensor, labels: torch.Tensor, smoothing: float):
    """(batch, tokens, classes) logits -> each example's mean loss over its labelled tokens."""
    nll = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
        label_smoothing=smoothing,
    ).view(labels.shape)
    count = (labels != IGNORE_INDEX).sum(1).clamp(min=1)
    return nll.sum(1) / count


@_task("causal-lm")
def causal_lm(x: LossInputs) -> torch.Tensor:
    """Next-token loss: position t predicts label t+1, averaged over the example's own tokens."""
    return _mean_over_own_tokens(x.logits[:, :-1], x.labels[:, 1:], x.label_smoothing)


@_task("token-classification")
def token_classification(x: LossInputs) -> torch.Tensor:
    """One label per token, averaged over the example's own labelled tokens."""
    return _mean_over_own_tokens(x.logits, x.labels, x.label_smoothing)


@_task("sequence-classification")
def sequence_classification(x: LossInputs) -> torch.Tensor:
    """The loss the model would compute (regression, single- or multi-label), per example."""
    logits, labels, cfg = x.logits.float(), x.labels, x.config
    num_labels = logits.shape[-1]
    problem = getattr(cfg, "problem_type", None)
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        diff = logits.reshape(len(logits), -1) - labels.to(logits.dtype).reshape(len(logits), -1)
        return diff.pow(2).mean(1)
    if problem == "single_label_classification":
        return F.cross_entropy(
            logits.view(-1, num_labels),
            labels.view(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
            label_smoothing=x.label_smoothing,
        )
    if problem == "multi_label_classification":
        bce = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
        return bce.mean(1)
    raise LossReductionError(f"unknown problem_type {problem!r} in the model config")


def _auto_tables() -> dict[str, str]:
    """Class name -> task, from transformers' auto-model tables."""
    from transformers.models.auto import modeling_auto as auto

    tables = {
        "causal-lm": auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "token-classification": auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
        "sequence-classification": auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    }
    out: dict[str, str] = {}
    for task, table in tables.items():
        for names in table.values():
            for name in (names,) if isinstance(names, str) else names:
                out.setdefault(name, task)
    return out


# dpfit's own classifier (dpfit.models.load_classifier: backbone -> pooling -> linear head)
# computes the single-label cross-entropy of a sequence classifier.
_DPFIT_MODELS = {"PooledClassifier": "sequence-classification"}


def register_per_example_loss(model_class: type | str, fn: PerExampleLoss) -> None:
    """Teach DPTrainer the per-example loss of a model class (and its subclasses).

    ``fn(LossInputs) -> Tensor`` of shape (batch,), where row i depends on example i only.
    """
    _USER_CLASSES[model_class if isinstance(model_class, str) else model_class.__name__] = fn


def base_model(model: Any) -> Any:
    """The model under a PEFT wrapper (whose class says which task head it is)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def per_example_loss_for(model: Any) -> tuple[str, PerExampleLoss]:
    """(task, loss) for this model, or LossReductionError if it has no known decomposition."""
    model = base_model(model)
    auto = {**_auto_tables(), **_DPFIT_MODELS}
    for cls in type(model).__mro__:
        if cls.__name__ in _USER_CLASSES:
            return cls.__name__, _USER_CLASSES[cls.__name__]
        if cls.__name__ in auto:
            task = auto[cls.__name__]
            return task, _TASK_LOSSES[task]
    name = type(model).__name__
    raise LossReductionError(
        f"DPTrainer cannot split the loss of {name} into per-example losses: it knows "
        f"{', '.join(sorted(_TASK_LOSSES))} heads (from transformers' AutoModelFor... tables). "
        "A model's own loss often averages over every token in the batch, which makes each "
        "example's clipped gradient depend on its neighbours, so it is not used. Use a "
        "supported head, or register the loss: dpfit.integrations.register_per_example_loss("
        f"{name}, fn) with fn(LossInputs) returning one loss per example, shape (batch,)."
    )

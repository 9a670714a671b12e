"""What trains: bias-only selection (BiTFiT), optionally plus named new heads."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from dpfit.errors import NoTrainableParametersError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainableSummary:
    trainable: int
    total: int
    names: tuple[str, ...]

    @property
    def fraction(self) -> float:
        return self.trainable / self.total if self.total else 0.0

    def __str__(self) -> str:
        return (
            f"{self.trainable:,} trainable of {self.total:,} parameters "
            f"({100 * self.fraction:.3f}%) in {len(self.names)} tensors"
        )


def is_bias(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf == "bias" or leaf.endswith("_bias")


def _unique_named_parameters(model: nn.Module):
    return model.named_parameters(remove_duplicate=True)


def summarize(model: nn.Module) -> TrainableSummary:
    named = list(_unique_named_parameters(model))
    train = [(n, p) for n, p in named if p.requires_grad]
    return TrainableSummary(
        trainable=sum(p.numel() for _, p in train),
        total=sum(p.numel() for _, p in named),
        names=tuple(n for n, _ in train),
    )


def make_bias_trainable(model: nn.Module, train_head: Iterable[str] = ()) -> TrainableSummary:
    """Freeze every parameter except biases and those under the named head modules.

    `train_head` holds module-name prefixes (e.g. "classifier", "score"); prefixes that match
    no parameter are an error so a typo cannot silently train nothing.
    """
    heads = tuple(train_head)
    matched = dict.fromkeys(heads, False)
    for name, p in _unique_named_parameters(model):
        in_head = [h for h in heads if name == h or name.startswith(h + ".")]
        for h in in_head:
            matched[h] = True
        p.requires_grad_(bool(in_head) or is_bias(name))
    missing = [h for h, ok in matched.items() if not ok]
    if missing:
        raise NoTrainableParametersError(
            f"train_head names {missing} match no parameter; module names look like "
            f"{[n for n, _ in list(model.named_modules())[1:6]]}"
        )
    summary = summarize(model)
    if not any(is_bias(n) for n in summary.names):
        raise NoTrainableParametersError(
            "the model has no bias terms to train; add zero-initialised biases first with "
            "dpfit.add_biases(model) (DP-BiTFiT-Add, CLI: --add-biases)"
        )
    log.info("bias-only training: %s", summary)
    return summary

"""Two-phase X+BiTFiT: X epochs of DP full fine-tuning, then DP-BiTFiT, under one budget.

Why two phases: bias-only training cannot move a from-scratch head's features far; a short
full phase does, and the cheap bias phase then uses the rest of the budget. Privacy is one
run: the noise multiplier is calibrated once for the total number of steps of all phases, and
one ledger records every step, so the epsilon reported after the switch is the composed one.

What trains in each phase:

* "full": every parameter of the model;
* "bias": the selection in force when the engine was built (call
  ``dpfit.make_bias_trainable(model, train_head=...)`` first); if everything was trainable
  then, the biases alone.

Switching removes the engine's hooks, changes ``requires_grad``, re-plans the layers and
registers fresh hooks; the optimizer is rebuilt (same class and hyper-parameters, new state)
because its parameter set changed.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dpfit.config import PHASE_MODES
from dpfit.errors import NoTrainableParametersError
from dpfit.params import is_bias

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Phase:
    """`epochs` passes over the data in `mode` ("full" or "bias")."""

    mode: str
    epochs: float

    def __post_init__(self) -> None:
        if self.mode not in PHASE_MODES:
            raise ValueError(f"phase mode must be one of {PHASE_MODES}, got {self.mode!r}")
        if not self.epochs > 0:
            raise ValueError(f"phase epochs must be > 0, got {self.epochs}")


PhaseSpec = Phase | tuple[str, float]


def parse_schedule(spec: Iterable[PhaseSpec]) -> tuple[Phase, ...]:
    """``[("full", 1), ("bias", 2)]`` -> phases; zero-epoch phases are dropped (0+BiTFiT)."""
    phases = []
    for item in spec:
        mode, epochs = (item.mode, item.epochs) if isinstance(item, Phase) else item
        if epochs == 0:
            continue
        phases.append(Phase(mode, epochs))
    if not phases:
        raise ValueError("the schedule has no phase with epochs > 0")
    return tuple(phases)


def total_epochs(phases: Sequence[Phase]) -> float:
    return sum(p.epochs for p in phases)


def bias_selection(model: nn.Module) -> frozenset[str]:
    """The parameters a bias phase trains: those trainable now, or the biases if all are."""
    named = list(model.named_parameters())
    chosen = [n for n, p in named if p.requires_grad]
    if len(chosen) == len(named):
        chosen = [n for n, _ in named if is_bias(n)]
    return frozenset(chosen)


def set_trainable(model: nn.Module, mode: str, selection: frozenset[str]) -> None:
    """requires_grad for a phase: every parameter ("full") or exactly `selection` ("bias")."""
    if mode == "bias" and not selection:
        raise NoTrainableParametersError(
            "a bias phase would train nothing: the model has no biases. Call "
            "dpfit.add_biases(model) before building the engine (DP-BiTFiT-Add)"
        )
    for name, p in model.named_parameters():
        p.requires_grad_(mode == "full" or name in selection)


def rebuild_optimizer(
    old: torch.optim.Optimizer, params: Sequence[nn.Parameter]
) -> torch.optim.Optimizer:
    """A new optimizer of the same class and hyper-parameters (from the first param group,
    e.g. a scheduled learning rate) over `params`, with fresh state."""
    group = old.param_groups[0]
    accepted = inspect.signature(type(old).__init__).parameters
    kwargs = {k: group.get(k, v) for k, v in old.defaults.items() if k in accepted}
    return type(old)(list(params), **kwargs)

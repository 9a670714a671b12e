"""Learning-rate schedules of the training loop: a multiplier of the base rate per step.

Why a function of the step index alone: the loop sets each step's rate from (step, total),
so a resumed run, whose step count comes back from the checkpoint, follows the same curve
with no scheduler state to save; and the two-phase switch, which rebuilds the optimizer,
keeps it. The schedule depends only on public quantities (the step count), so it costs no
privacy.

* ``constant``: the base rate throughout (the default of every run);
* ``cosine``: half a cosine from the base rate down to zero at the last step (Loshchilov &
  Hutter 2017, "SGDR"), the usual choice when training a fresh model for many epochs, as
  ``dpfit pretrain`` does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _constant(step: int, total: int) -> float:
    return 1.0


def _cosine(step: int, total: int) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * min(step, total) / max(total, 1)))


LR_SCHEDULES: dict[str, Callable[[int, int], float]] = {"constant": _constant, "cosine": _cosine}


def lr_factor(schedule: str, step: int, total: int) -> float:
    """Multiplier of the base learning rate for 0-based logical step `step` of `total`."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {sorted(LR_SCHEDULES)}, got {schedule!r}")
    return LR_SCHEDULES[schedule](step, total)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

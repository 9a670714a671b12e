"""Public pretraining defaults: how long and how to train a fresh image model on public data.

Why a rule of its own: ``dpfit pretrain`` trains every weight of a randomly initialised
model, where the fine-tuning recipe (:mod:`dpfit.recipe`) assumes pretrained features and a
few passes. A fixed epoch count does not fit both a small public share and a large public
corpus: 3 epochs of 6,000 FashionMNIST images (141 steps) leave resnet-gn far from
converged. The rule sizes the run in optimizer steps instead, from the public n alone:

* **Epochs**: the fewest that give PRETRAIN_STEPS steps of PRETRAIN_BATCH, between
  PRETRAIN_MIN_EPOCHS and PRETRAIN_MAX_EPOCHS (the cap bounds CPU time on tiny public sets,
  where more passes mostly memorise);
* **Cosine learning rate** from PRETRAIN_LR to zero, the usual schedule for training from
  scratch, so the last epochs refine instead of oscillating at the peak rate;
* **Shift augmentation** (each image moved by up to 1/14 of its side): label-preserving on
  nearly any image, and it stretches a small public set; mirroring (``shift-flip``) is
  opt-in, since it is wrong for digits or text.

The rule reads only the number of public examples, never the private data. Every value can
be overridden (``--epochs``, ``--lr``, ``--lr-schedule``, ``--augment``, ...).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

PRETRAIN_STEPS = 2000
PRETRAIN_MIN_EPOCHS = 3
PRETRAIN_MAX_EPOCHS = 40
PRETRAIN_BATCH = 128
PRETRAIN_LR = 2e-3
PRETRAIN_LR_SCHEDULE = "cosine"
PRETRAIN_AUGMENT = "shift"
# epochs None: pretrain_epochs(public n, batch) when the public data has been read
PRETRAIN_DEFAULTS = dict(
    epochs=None,
    batch_size=PRETRAIN_BATCH,
    physical_batch_size=PRETRAIN_BATCH,
    lr=PRETRAIN_LR,
    lr_schedule=PRETRAIN_LR_SCHEDULE,
    augment=PRETRAIN_AUGMENT,
)


def pretrain_epochs(n_public: int, batch_size: int = PRETRAIN_BATCH) -> int:
    """Passes over `n_public` images for about PRETRAIN_STEPS steps of `batch_size`, within
    [PRETRAIN_MIN_EPOCHS, PRETRAIN_MAX_EPOCHS]; pure."""
    if n_public < 1 or batch_size < 1:
        raise ValueError(f"need n_public >= 1 and batch_size >= 1, got {n_public}, {batch_size}")
    per_epoch = math.ceil(n_public / min(batch_size, n_public))
    return min(PRETRAIN_MAX_EPOCHS, max(PRETRAIN_MIN_EPOCHS, math.ceil(PRETRAIN_STEPS / per_epoch)))


def pretrain(config, on_step=None, on_note: Callable[[str], None] | None = None):
    """:func:`dpfit.train.train` for a non-private run on public images, with the epochs
    from :func:`pretrain_epochs` when `config.epochs` is None (the data is read once)."""
    from dpfit.tasks import get_task
    from dpfit.train import train

    set_by = "dpfit pretrain's defaults (vision/pretrain.py) and any flags given"
    if config.epochs is not None:
        return train(config, on_step=on_step, on_note=on_note, set_by=set_by)
    if not config.non_private:
        raise ValueError("pretrain is non-private training on public data")
    task = get_task(config.task)
    prep = task.prepare(config)
    batch = config.batch_size or PRETRAIN_BATCH
    epochs = pretrain_epochs(prep.n, batch)
    steps = epochs * math.ceil(prep.n / min(batch, prep.n))  # the loop's steps per epoch
    if on_note is not None:
        on_note(
            f"pretraining length from the public n={prep.n}: {epochs} epochs, {steps} steps "
            f"of {batch} (the rule aims at {PRETRAIN_STEPS} steps within "
            f"[{PRETRAIN_MIN_EPOCHS}, {PRETRAIN_MAX_EPOCHS}] epochs)"
        )
    config = dataclasses.replace(config, epochs=epochs)
    return train(config, on_step=on_step, on_note=on_note, prepared=prep, task=task, set_by=set_by)

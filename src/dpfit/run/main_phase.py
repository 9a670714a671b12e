"""The main phase's parts: its engine (carrying the head-first ledger), optimizer and loader,
and the X+BiTFiT switch from full to bias-only."""

from __future__ import annotations

import logging
from collections.abc import Callable

from dpfit.lr_schedules import set_lr
from dpfit.run.config import OPTIMIZERS, TrainConfig
from dpfit.run.plain import PlainStepper, ShuffledBatches
from dpfit.run.resolve import insecure_seed
from dpfit.windows import GROUPED_UNITS

logger = logging.getLogger(__name__)


def enter_bias_phase(engine, optimizer, lr: float, note: Callable[[str], None]):
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


def make_engine(
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
        insecure_seed=insecure_seed(config),
        neighbouring=config.neighbouring,
        # a document's windows or a user's rows: the engine sums and clips each item's rows
        privacy_unit="document" if config.privacy_unit in GROUPED_UNITS else "example",
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


def main_setup(
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
        engine = make_engine(model, config, n, total_steps, delta, sigma)
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

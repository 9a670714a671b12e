"""The head-first phase: a private linear probe on frozen features, before biases + head
train (its steps are composed into the run's one ledger)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from dpfit import progress
from dpfit.frozen_casts import FrozenWeightCasts
from dpfit.precision import autocast
from dpfit.run.config import OPTIMIZERS, TrainConfig
from dpfit.run.plain import PlainStepper, ShuffledBatches
from dpfit.run.resolve import insecure_seed

logger = logging.getLogger(__name__)


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


def collate_features(items: list[tuple[torch.Tensor, int]]) -> dict:
    if not items:
        return {"x": torch.zeros(0), "y": torch.zeros(0, dtype=torch.long)}
    return {
        "x": torch.stack([x for x, _ in items]),
        "y": torch.tensor([y for _, y in items], dtype=torch.long),
    }


def head_phase(
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
        loader = ShuffledBatches(data, config.batch_size, len(data), collate_features, config.seed)
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
            insecure_seed=insecure_seed(config, offset=1_000_003),
            neighbouring=config.neighbouring,
        )
        params = engine.parameters()
    optimizer = OPTIMIZERS[config.optimizer](params, config.head_lr, config.weight_decay)
    if engine is not None:  # the optimizer first: an empty first batch steps at once
        loader = engine.data_loader(
            data, collate_features, physical_batch_size=len(data), optimizer=optimizer
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


def score_before(task, prep, model, config, device, note: Callable[[str], None], what: str) -> dict:
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

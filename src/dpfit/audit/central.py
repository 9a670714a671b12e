"""Central DP-SGD audits: one training run of the real PrivacyEngine, its Poisson loader and
accountant, with canaries mixed into the data.

white_box_audit: gradient canaries in the trained bias space, scored from every released
(noised) gradient. black_box_audit: input canaries (e.g. mislabelled examples), scored by the
final model's loss. Both return an AuditResult with the one-run lower bound (bounds.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from dpfit.audit.bounds import AuditError, best_bound, default_splits
from dpfit.audit.canaries import SCORES, GradientCanaries, draw_inclusion, scores_from_observations
from dpfit.errors import BudgetExhaustedError

log = logging.getLogger(__name__)

TaskLosses = Callable[[nn.Module, dict], torch.Tensor]  # (model, batch) -> per-row losses (n,)


@dataclass(frozen=True)
class AuditConfig:
    """One audit run. The engine is built exactly as `dpfit train` builds it (target epsilon
    calibrated for `steps` at rate q, flat or automatic clipping, mean loss, Poisson loader)."""

    epsilon: float = 8.0
    delta: float = 1e-5
    noise_multiplier: float | None = None  # given: no calibration; the claim is its epsilon
    canaries: int = 1000
    steps: int = 1
    sample_rate: float = 1.0  # q; the expected batch is round(q * N), N = real + canary slots
    max_grad_norm: float = 1.0
    clipping: str = "flat"
    accountant: str = "rdp"
    canary_scale: float = 10.0  # white-box canary gradient norm, in units of the clip norm
    score: str = "llr"  # white-box: llr | sum | max
    splits: tuple[tuple[int, int], ...] = ()  # (k+, k-) guesses tried; () = default_splits(m)
    confidence: float = 0.95
    lr: float = 0.05
    physical_batch_size: int | None = None
    seed: int = 0  # public randomness: canary directions
    insecure_seed: int | None = None  # fixes noise, sampling and inclusion (tests only)

    def __post_init__(self) -> None:
        if self.canaries < 2:
            raise AuditError(f"canaries must be >= 2, got {self.canaries}")
        if self.steps < 1:
            raise AuditError(f"steps must be >= 1, got {self.steps}")
        if not 0 < self.sample_rate <= 1:
            raise AuditError(f"sample_rate must be in (0, 1], got {self.sample_rate}")
        if not 0 < self.confidence < 1:
            raise AuditError(f"confidence must be in (0, 1), got {self.confidence}")
        if self.score not in SCORES:
            raise AuditError(f"score must be one of {SCORES}, got {self.score!r}")
        if self.epsilon <= 0:
            raise AuditError(f"epsilon must be > 0, got {self.epsilon}")


@dataclass(frozen=True)
class AuditResult:
    kind: str
    epsilon_claimed: float  # what the accountant reports for the run that happened
    epsilon_target: float
    delta: float
    epsilon_lower_bound: float
    confidence: float
    epsilon_ceiling: float  # the bound with every guess right: claims above it cannot fail
    canaries: int
    included: int
    guesses: int
    correct: int
    k_plus: int
    k_minus: int
    noise_multiplier: float
    sample_rate: float
    steps: int
    score: str
    seconds: float
    tried: tuple = ()
    scores: tuple[float, ...] = field(default=(), repr=False)
    included_mask: tuple[bool, ...] = field(default=(), repr=False)
    notes: tuple[str, ...] = ()

    @property
    def ratio(self) -> float:
        return self.epsilon_lower_bound / self.epsilon_claimed if self.epsilon_claimed else 0.0

    @property
    def violated(self) -> bool:
        """True when the audit proves the claim false (at the stated confidence)."""
        return self.epsilon_lower_bound > self.epsilon_claimed

    def to_dict(self, with_scores: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["tried"] = [
            dict(zip(("k_plus", "k_minus", "guesses", "correct", "bound"), t, strict=True))
            for t in self.tried
        ]
        d["ratio"] = self.ratio
        d["violated"] = self.violated
        if not with_scores:
            d.pop("scores")
            d.pop("included_mask")
        return d


class _Released:
    """Wraps the optimizer; before each step hands the released (noised) gradients to a
    callback. That is the white-box auditor's view: DP-SGD publishes these."""

    def __init__(self, optimizer: torch.optim.Optimizer, on_release: Callable[[], None]):
        self.optimizer = optimizer
        self.on_release = on_release

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        self.on_release()
        return self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def _with_slots(items: Sequence[dict], canary_items: Sequence[dict], live: torch.Tensor):
    real = [{**it, "_canary": -1, "_live": 1.0} for it in items]
    slots = [{**c, "_canary": j, "_live": float(live[j])} for j, c in enumerate(canary_items)]
    return real + slots


def _collate_with_slots(collate: Callable[[list], dict]) -> Callable[[list], dict]:
    def inner(rows: list[dict]) -> dict:
        ids = torch.tensor([r["_canary"] for r in rows], dtype=torch.long)
        live = torch.tensor([r["_live"] for r in rows], dtype=torch.float32)
        batch = collate(
            [{k: v for k, v in r.items() if k not in ("_canary", "_live")} for r in rows]
        )
        batch["_canary"], batch["_live"] = ids, live
        return batch

    return inner


def make_engine(model: nn.Module, n: int, cfg: AuditConfig):
    import dpfit

    privacy: dict[str, Any] = (
        {"noise_multiplier": cfg.noise_multiplier}
        if cfg.noise_multiplier is not None
        else {"target_epsilon": cfg.epsilon, "steps": cfg.steps}
    )
    return dpfit.PrivacyEngine(
        model,
        expected_batch_size=max(1, round(cfg.sample_rate * n)),
        sample_size=n,
        target_delta=cfg.delta,
        **privacy,
        max_grad_norm=cfg.max_grad_norm,
        clipping=cfg.clipping,
        loss_reduction="mean",
        accountant=cfg.accountant,
        insecure_seed=cfg.insecure_seed,
    )


def train_with_engine(
    model: nn.Module,
    items: list[dict],
    collate: Callable[[list], dict],
    batch_loss: Callable[[dict], torch.Tensor],
    cfg: AuditConfig,
    on_release: Callable[[Any], None] | None = None,
    device: torch.device | None = None,
):
    """The `dpfit train` loop over the engine's Poisson loader for cfg.steps logical steps."""
    engine = make_engine(model, len(items), cfg)
    sgd = torch.optim.SGD(engine.parameters(), lr=cfg.lr)
    opt = _Released(sgd, (lambda: on_release(engine)) if on_release else (lambda: None))
    loader = engine.data_loader(
        items, collate_fn=collate, physical_batch_size=cfg.physical_batch_size, optimizer=opt
    )
    model.train()
    try:
        passes = 0
        while engine.steps_taken < cfg.steps:
            for batch in loader:
                if device is not None:
                    batch = {k: v.to(device) for k, v in batch.items()}
                batch_loss(batch).backward()
                engine.step(opt)
                if engine.steps_taken >= cfg.steps:
                    break
            passes += 1
            if passes > 10 * cfg.steps + 10:  # pragma: no cover - only with no optimizer step
                raise AuditError("the loader produced no steps")
    except BudgetExhaustedError as e:  # trailing empty Poisson batches hit the budget
        log.info("audit run stopped at the budget: %s", e)
    finally:
        engine.detach()
    return engine


def _splits(cfg: AuditConfig) -> list[tuple[int, int]]:
    return list(cfg.splits) or default_splits(cfg.canaries)


def _inclusion(cfg: AuditConfig) -> torch.Tensor:
    return draw_inclusion(
        cfg.canaries, None if cfg.insecure_seed is None else cfg.insecure_seed + 7
    )


def _result(kind, cfg, engine, scores, included, t0, notes=()) -> AuditResult:
    claimed = engine.epsilon()
    b = best_bound(
        scores.tolist(), included.tolist(), _splits(cfg), engine.target_delta, cfg.confidence
    )
    return AuditResult(
        kind=kind,
        epsilon_claimed=claimed,
        epsilon_target=cfg.epsilon if cfg.noise_multiplier is None else claimed,
        delta=engine.target_delta,
        epsilon_lower_bound=b.epsilon_lower_bound,
        confidence=cfg.confidence,
        epsilon_ceiling=b.ceiling,
        canaries=cfg.canaries,
        included=int(included.sum()),
        guesses=b.guesses,
        correct=b.correct,
        k_plus=b.k_plus,
        k_minus=b.k_minus,
        noise_multiplier=engine.noise_multiplier,
        sample_rate=engine.sample_rate,
        steps=engine.steps_taken,
        score=cfg.score if kind == "white-box" else "loss",
        seconds=time.perf_counter() - t0,
        tried=b.tried,
        scores=tuple(float(s) for s in scores),
        included_mask=tuple(bool(x) for x in included),
        notes=tuple(notes),
    )


def white_box_audit(
    model: nn.Module,
    real_items: Sequence[dict],
    collate: Callable[[list], dict],
    task_losses: TaskLosses,
    targets: Sequence[str],
    cfg: AuditConfig,
    template: dict | None = None,
    device: torch.device | None = None,
) -> AuditResult:
    """Gradient canaries in the biases of `targets`, scored from every released gradient.

    `template` is the input a canary row carries (its content does not matter: the audited
    module's input is zeroed for canary rows); default: the first real item.
    """
    t0 = time.perf_counter()
    m = cfg.canaries
    included = _inclusion(cfg)
    canaries = GradientCanaries(model, targets, m, cfg.canary_scale, cfg.seed)
    if template is None:
        if not real_items:
            raise AuditError("give a template input for the canary rows or some real data")
        template = real_items[0]
    items = _with_slots(real_items, [template] * m, included)
    observed: list[torch.Tensor] = []

    def batch_loss(batch: dict) -> torch.Tensor:
        ids, live = batch.pop("_canary"), batch.pop("_live")
        with canaries.active(ids) as outs:
            per_row = task_losses(model, batch)
        real = ids.to(per_row.device) < 0
        rows = torch.where(real, per_row, torch.zeros_like(per_row))
        rows = rows + canaries.loss_terms(outs, ids.to(per_row.device), live.to(per_row.device))
        return rows.mean()

    def on_release(engine) -> None:
        grads = {k: canaries.bias(k).grad for k in range(len(canaries.targets))}
        if any(g is None for g in grads.values()):
            raise AuditError("an audited bias got no released gradient; is it trained?")
        units = engine.config.expected_batch_size / engine.max_grad_norm
        observed.append(canaries.observe(grads) * units)

    engine = train_with_engine(
        model, items, _collate_with_slots(collate), batch_loss, cfg, on_release, device
    )
    x = torch.stack(observed) if observed else torch.zeros(1, m)
    scores = scores_from_observations(x, cfg.score, engine.sample_rate, engine.noise_multiplier)
    notes = [f"white-box canaries in {', '.join(canaries.targets)}"]
    return _result("white-box", cfg, engine, scores, included, t0, notes)


@torch.no_grad()
def per_item_losses(
    model: nn.Module,
    items: Sequence[dict],
    collate: Callable[[list], dict],
    task_losses: TaskLosses,
    batch_size: int = 64,
    device: torch.device | None = None,
) -> torch.Tensor:
    was = model.training
    model.eval()
    out = []
    for i in range(0, len(items), batch_size):
        batch = collate(list(items[i : i + batch_size]))
        if device is not None:
            batch = {k: v.to(device) for k, v in batch.items()}
        out.append(task_losses(model, batch).float().cpu())
    model.train(was)
    return torch.cat(out)


def black_box_audit(
    model: nn.Module,
    real_items: Sequence[dict],
    canary_items: Sequence[dict],
    collate: Callable[[list], dict],
    task_losses: TaskLosses,
    cfg: AuditConfig,
    device: torch.device | None = None,
) -> AuditResult:
    """Input canaries (give mislabelled or out-of-distribution items), scored by -loss of the
    final model: a member should have a lower loss."""
    t0 = time.perf_counter()
    if len(canary_items) != cfg.canaries:
        raise AuditError(f"got {len(canary_items)} canary items for {cfg.canaries} canaries")
    included = _inclusion(cfg)
    items = _with_slots(real_items, canary_items, included)

    def batch_loss(batch: dict) -> torch.Tensor:
        batch.pop("_canary")
        live = batch.pop("_live")
        per_row = task_losses(model, batch)
        return (per_row * live.to(per_row.device)).mean()

    engine = train_with_engine(
        model, items, _collate_with_slots(collate), batch_loss, cfg, None, device
    )
    scores = -per_item_losses(model, canary_items, collate, task_losses, device=device)
    return _result("black-box", cfg, engine, scores, included, t0)

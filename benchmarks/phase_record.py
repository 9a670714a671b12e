"""What the phase after a head-first probe did to the model the probe left, in numbers.

A run whose final test accuracy equals its probe's to the example could be a phase that never
trained, or one whose changes fixed as many test predictions as they broke. `PhaseRecorder`
tells the two apart: it is the classification task plug-in that `dpfit.train` runs anyway,
and it also keeps each evaluation's test predictions and the trainable parameters at that
moment (the probe is scored before the main phase, the final model after it).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from dpfit.reporting import StepRow
from dpfit.tasks.classification import ClassificationTask, encode, make_collate


@dataclass(frozen=True)
class Snapshot:
    predictions: tuple[int, ...]  # argmax on each test example, in the test file's order
    backbone: dict[str, torch.Tensor]  # trainable parameters outside the head
    head: dict[str, torch.Tensor]


class PhaseRecorder(ClassificationTask):
    """The classification task, keeping a `Snapshot` at every evaluation."""

    def __init__(self) -> None:
        self.snapshots: list[Snapshot] = []
        self.labels: tuple[int, ...] = ()

    def evaluate(self, prep, model, config, device) -> dict:
        scores = super().evaluate(prep, model, config, device)
        test = prep.state["data"].test
        self.labels = tuple(test.labels)
        heads = tuple(prep.head_names)
        params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        in_head = {n for n in params if any(n == h or n.startswith(h + ".") for h in heads)}
        predictions = _predictions(model, prep.tokenizer, test, config, device)
        right = sum(p == y for p, y in zip(predictions, self.labels, strict=True))
        if self.labels and right / len(self.labels) != scores["accuracy"]:
            raise RuntimeError(  # the record must describe the model that was scored
                f"PhaseRecorder's predictions give accuracy {right / len(self.labels):.4f}, "
                f"the task's evaluation {scores['accuracy']:.4f}"
            )
        self.snapshots.append(
            Snapshot(
                predictions=predictions,
                backbone={n: t for n, t in params.items() if n not in in_head},
                head={n: t for n, t in params.items() if n in in_head},
            )
        )
        return scores


@torch.no_grad()
def _predictions(model, tokenizer, test, config, device) -> tuple[int, ...]:
    """Argmax on each test text, encoded and truncated as `dpfit.tasks.classification.evaluate`
    does (batches padded to their own longest text)."""
    items = encode(test, tokenizer, config.max_length)
    collate = make_collate(tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    out: list[int] = []
    for start in range(0, len(items), config.eval_batch_size):
        batch = collate(items[start : start + config.eval_batch_size])
        batch.pop("labels")
        out += model(**{k: v.to(device) for k, v in batch.items()}).logits.argmax(-1).tolist()
    model.train(was_training)
    return tuple(out)


def _canonical(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Names without peft's `base_layer.`: a LoRA run's probe is scored on the wrapped model
    and its final model after the adapters are merged, so the same weight has two names."""
    return {n.replace(".base_layer.", "."): t for n, t in params.items()}


def _l2(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    """L2 change over the parameters trainable in both snapshots (LoRA factors, merged away
    in the final model, are counted by `_only_in_one`, not here)."""
    after, before = _canonical(after), _canonical(before)
    common = [n for n in before if n in after]
    return float(sum(((after[n] - before[n]).double() ** 2).sum() for n in common) ** 0.5)


def _only_in_one(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> int:
    after, before = _canonical(after), _canonical(before)
    return len(set(after) ^ set(before))


def _norm(params: dict[str, torch.Tensor]) -> float:
    return float(sum((t.double() ** 2).sum() for t in params.values()) ** 0.5)


def epoch_losses(rows: list[StepRow]) -> list[float]:
    """Mean training loss of each epoch of the main phase (non-private runs only: a private
    run keeps no loss)."""
    by_epoch: dict[int, list[float]] = {}
    for r in rows:
        if r.loss is not None:
            by_epoch.setdefault(r.epoch, []).append(r.loss)
    return [statistics.fmean(by_epoch[e]) for e in sorted(by_epoch)]


def phase_record(recorder: PhaseRecorder, rows: list[StepRow]) -> dict | None:
    """Probe (first evaluation) against final model (last): test predictions newly right and
    newly wrong, how far the trainable weights moved, the training loss by epoch. None when
    the run scored no probe (no head-first phase)."""
    if len(recorder.snapshots) < 2:
        return None
    probe, final = recorder.snapshots[0], recorder.snapshots[-1]
    y = recorder.labels
    pairs = list(zip(probe.predictions, final.predictions, y, strict=True))
    return {
        "test_n": len(y),
        "predictions_changed": sum(a != b for a, b, _ in pairs),
        "newly_right": sum(a != t and b == t for a, b, t in pairs),
        "newly_wrong": sum(a == t and b != t for a, b, t in pairs),
        "backbone_change_l2": _l2(final.backbone, probe.backbone),
        "backbone_norm": _norm(probe.backbone),
        # trainable in one snapshot only (LoRA factors): not in backbone_change_l2
        "backbone_not_compared": _only_in_one(final.backbone, probe.backbone),
        "head_change_l2": _l2(final.head, probe.head),
        "epoch_losses": epoch_losses(rows),
    }

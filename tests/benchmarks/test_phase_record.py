"""phase_record: tells a phase after the head-first probe that trained from one that did not,
and an unchanged accuracy from unchanged predictions."""

from __future__ import annotations

import pytest
from benchmark_scripts import load_benchmark

from dpfit.train import TrainConfig, train


@pytest.fixture(scope="module")
def phase():
    return load_benchmark("phase_record")


def _run(phase, tiny, lr: float):
    model, data = tiny
    cfg = TrainConfig(
        model=model, data=data, non_private=True, head_first=True, epochs=2, batch_size=30,
        physical_batch_size=8, lr=lr, seed=0,
    )  # fmt: skip
    recorder = phase.PhaseRecorder()
    result = train(cfg, task=recorder)
    return result, phase.phase_record(recorder, result.steps)


def test_a_training_phase_moves_the_biases_and_the_counts_add_up(phase, tiny):
    result, rec = _run(phase, tiny, lr=0.05)
    n = rec["test_n"]
    assert n == result.metrics["eval_n"]
    assert rec["backbone_change_l2"] > 0 and rec["head_change_l2"] > 0
    # the accuracy change is exactly newly right minus newly wrong
    gained = round((result.metrics["accuracy"] - result.metrics["head_first_accuracy"]) * n)
    assert rec["newly_right"] - rec["newly_wrong"] == gained
    assert rec["newly_right"] + rec["newly_wrong"] <= rec["predictions_changed"]
    assert len(rec["epoch_losses"]) == 2  # one mean per epoch of the main phase


def _recorder(phase, before: tuple, after: tuple, labels: tuple, moved: float):
    import torch

    rec = phase.PhaseRecorder()
    rec.labels = labels
    b = {"bias": torch.zeros(3)}
    rec.snapshots = [
        phase.Snapshot(before, b, {"w": torch.zeros(2)}),
        phase.Snapshot(after, {"bias": torch.full((3,), moved)}, {"w": torch.zeros(2)}),
    ]
    return rec


def test_a_phase_that_does_not_train_changes_nothing(phase):
    rec = phase.phase_record(_recorder(phase, (0, 1, 2), (0, 1, 2), (0, 1, 1), 0.0), [])
    assert rec["predictions_changed"] == 0 and rec["backbone_change_l2"] == 0
    assert rec["newly_right"] == rec["newly_wrong"] == 0 and rec["epoch_losses"] == []


def test_an_unchanged_accuracy_with_changed_predictions_is_told_apart(phase):
    # labels 0 1 1 2: the probe gets 0 and 1 right, the final model 0 and the other 1
    rec = phase.phase_record(_recorder(phase, (0, 1, 0, 0), (0, 2, 1, 0), (0, 1, 1, 2), 1.0), [])
    assert rec["predictions_changed"] == 2
    assert rec["newly_right"] == rec["newly_wrong"] == 1
    assert rec["backbone_change_l2"] == pytest.approx(3**0.5)


def test_no_probe_no_record(phase):
    assert phase.phase_record(phase.PhaseRecorder(), []) is None


def test_lora_runs_compare_each_weight_under_one_name_and_count_the_merged_factors(phase):
    """A LoRA run's probe is scored on the peft-wrapped model (`query.base_layer.bias`, the
    factors trainable) and its final model after the factors are merged (`query.bias`)."""
    import torch

    rec = phase.PhaseRecorder()
    rec.labels = (0, 1)
    before = {
        "q.base_layer.bias": torch.zeros(3),
        "q.lora_A.default.weight": torch.ones(2, 3),
        "q.lora_B.default.weight": torch.zeros(3, 2),
    }
    after = {"q.bias": torch.full((3,), 2.0)}
    rec.snapshots = [
        phase.Snapshot((0, 1), before, {"w": torch.zeros(2)}),
        phase.Snapshot((0, 1), after, {"w": torch.zeros(2)}),
    ]
    out = phase.phase_record(rec, [])
    assert out["backbone_change_l2"] == pytest.approx(12**0.5)  # the bias, matched by name
    assert out["backbone_not_compared"] == 2  # the two factors, merged away

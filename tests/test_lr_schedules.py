"""Learning-rate schedules: the curve, and that the loop hands each step its rate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from image_tasks import patterns

from dpfit.lr_schedules import LR_SCHEDULES, lr_factor
from dpfit.tasks.image_classification import ImageOptions
from dpfit.train import TrainConfig, train


def test_cosine_falls_from_one_to_zero_and_constant_stays():
    assert set(LR_SCHEDULES) == {"constant", "cosine"}
    assert [lr_factor("constant", s, 10) for s in (0, 5, 9)] == [1.0, 1.0, 1.0]
    assert lr_factor("cosine", 0, 10) == 1.0
    assert lr_factor("cosine", 5, 10) == pytest.approx(0.5)
    assert lr_factor("cosine", 10, 10) == pytest.approx(0.0, abs=1e-12)
    curve = [lr_factor("cosine", s, 10) for s in range(10)]
    assert curve == sorted(curve, reverse=True) and curve[-1] > 0  # the last step still moves
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        lr_factor("linear", 0, 10)
    with pytest.raises(ValueError, match="lr_schedule must be one of"):
        TrainConfig(lr_schedule="linear", non_private=True, epsilon=None)


@pytest.mark.parametrize("private", [False, True])
def test_the_loop_sets_each_logical_step_its_rate(tmp_path, monkeypatch, private):
    """Every logical step runs at lr * factor(step, total), private or not (a loop that
    ignored the schedule, or indexed it by physical batch, fails here)."""
    images, labels = patterns(64, 8, seed=3)
    np.savez(tmp_path / "d.npz", images=images, labels=labels)
    seen: list[float] = []
    real_step = torch.optim.AdamW.step

    def spy(self, *a, **k):  # the rate the optimizer actually uses at each step
        seen.append(self.param_groups[0]["lr"])
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    privacy = dict(noise_multiplier=1.0) if private else dict(non_private=True, epsilon=None)
    config = TrainConfig(
        task="image-classification", data=str(tmp_path / "d.npz"), model="resnet-gn",
        mode="full", epochs=2, batch_size=16, physical_batch_size=8, lr=1e-2,
        lr_schedule="cosine", task_options=ImageOptions(image_size=8), public_labels=True,
        **privacy,
    )  # fmt: skip
    m = train(config).metrics
    total = m["steps"]
    assert m["lr_schedule"] == "cosine" and total >= 6
    assert len(seen) == total
    want = [1e-2 * lr_factor("cosine", s, total) for s in range(total)]
    assert seen == pytest.approx(want, rel=1e-12)
    assert math.isclose(seen[0], 1e-2) and seen[-1] < 0.1 * 1e-2

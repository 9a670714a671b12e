"""What a private run's public per-step file may carry.

steps.csv is declared public, so it must be a function of public quantities only: which steps
drew an empty Poisson batch, how large each batch was and how long each step took are not.
"""

from __future__ import annotations

import csv

import dp_accounting
import pytest
import torch

from dpfit.reporting import PRIVATE_STEP_FIELDS
from dpfit.sampling import PoissonBatchSampler
from dpfit.train import TrainConfig, train

STEPS = 8


def scripted_draws(monkeypatch, sizes: list[int]) -> list[int]:
    """Logical batch k (1-based) draws the first sizes[k-1] examples: 0 is an empty batch,
    a noise-only step; past the script, 30. Returns the list of sizes actually drawn (the
    loader may draw one batch beyond the last step)."""
    drawn: list[int] = []

    def draw_all(self) -> torch.Tensor:
        size = sizes[len(drawn)] if len(drawn) < len(sizes) else 30
        drawn.append(size)
        return torch.arange(size)

    monkeypatch.setattr(PoissonBatchSampler, "_draw_all", draw_all)
    return drawn


def run(tiny, tmp_path, name: str, sizes: list[int], monkeypatch):
    model, data = tiny
    drawn = scripted_draws(monkeypatch, sizes)
    config = TrainConfig(
        model=model, data=data, epochs=2, batch_size=30, physical_batch_size=8, lr=0.05,
        epsilon=3.0, head_first=False, max_steps=STEPS, output=str(tmp_path / name),
    )  # fmt: skip
    result = train(config)
    assert drawn[:STEPS] == sizes, "the run did not draw the scripted batches"
    return result, (tmp_path / name / "steps.csv").read_bytes()


def independent_epsilons(sigma: float, q: float, delta: float) -> list[float]:
    """Epsilon after each of steps 1..STEPS, straight from dp-accounting's RDP accountant."""
    out = []
    for k in range(1, STEPS + 1):
        acc = dp_accounting.rdp.RdpAccountant()
        event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
        acc.compose(dp_accounting.SelfComposedDpEvent(event, k))
        out.append(acc.get_epsilon(delta))
    return out


def test_steps_csv_does_not_tell_which_steps_were_empty(tiny, tmp_path, monkeypatch):
    # empty batches at steps 2 and 5 in one run, at 3, 4 and 8 in the other; the batch sizes
    # of the other steps differ too (a step's duration tracks its batch size)
    a_sizes = [30, 0, 12, 40, 0, 25, 33, 28]
    b_sizes = [8, 45, 0, 0, 31, 29, 50, 0]
    a, a_csv = run(tiny, tmp_path, "a", a_sizes, monkeypatch)
    b, b_csv = run(tiny, tmp_path, "b", b_sizes, monkeypatch)
    assert a.metrics["steps"] == b.metrics["steps"] == STEPS
    assert a_csv == b_csv  # byte for byte, epsilon column included

    rows = list(csv.DictReader(a_csv.decode().splitlines()))
    assert tuple(rows[0]) == PRIVATE_STEP_FIELDS
    assert not {"elapsed_s", "loss", "batch_size"} & set(rows[0])
    assert all(r.elapsed_s is None and r.loss is None for r in a.steps + b.steps)
    # each row's epsilon is the one after its own step (not the step it was recorded with)
    m = a.metrics
    expected = independent_epsilons(m["noise_multiplier"], m["sample_rate"], m["delta"])
    assert [float(r["epsilon"]) for r in rows] == pytest.approx(expected, rel=1e-9)
    assert float(rows[-1]["epsilon"]) == pytest.approx(m["epsilon"], rel=1e-9)
    # the total time is still reported (it is declared public in docs/threat-model.md)
    assert m["train_time_s"] > 0


def test_non_private_steps_csv_keeps_its_timing(tiny, tmp_path):
    model, data = tiny
    config = TrainConfig(
        model=model, data=data, epochs=1, batch_size=30, physical_batch_size=8, lr=0.05,
        non_private=True, max_steps=3, output=str(tmp_path / "plain"),
    )  # fmt: skip
    res = train(config)
    rows = list(csv.DictReader((tmp_path / "plain" / "steps.csv").read_text().splitlines()))
    assert len(rows) == 3 and all(float(r["elapsed_s"]) >= 0 for r in rows)
    assert all(r.elapsed_s is not None for r in res.steps)

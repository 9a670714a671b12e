"""The batch-axis check does not rely on shapes: one example's row is
compared with its gradient computed alone, at run time, before anything is released."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dpfit
from dpfit.errors import BatchAxisError, SamplingError


class SeqFirst(nn.Module):
    """Takes (B, T, D) batches, runs its layers sequence-first (T, B, D); T == B fools any
    row count."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6), nn.Dropout(dropout))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.body(x.transpose(0, 1))).mean(0)


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int, t: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, t, 6, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("sampling", ["poisson", "user-poisson"])
def test_sequence_first_model_with_t_equal_b_is_caught_before_any_release(sampling):
    n = t = 5  # q = 1: every logical batch holds all 5 examples, so rows (T = 5) == B
    model = SeqFirst()
    dpfit.make_bias_trainable(model)
    before = _params(model)
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=n, sample_size=n, noise_multiplier=1.0, sampling=sampling
    )
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    data = Data(n, t)
    with pytest.raises(BatchAxisError, match="batch_first"):
        if sampling == "poisson":
            for x, y in engine.data_loader(data, optimizer=opt):
                assert len(x) == t
                nn.functional.cross_entropy(model(x), y).backward()
                engine.step(opt)
        else:
            nn.functional.cross_entropy(model(data.x), data.y).backward()
            engine.step(opt, batch_size=n)
    assert engine.steps_taken == 0  # no noised step was applied
    after = _params(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_declared_sequence_first_model_passes_and_the_probe_changes_nothing(dropout):
    """batch_first=False: the probe passes (dropout too: it reruns in eval mode), and the
    run is the very run it would be without the probe (same RNG streams, same updates)."""

    def run(check: bool) -> tuple[dict, torch.Tensor]:
        model = SeqFirst(dropout)
        dpfit.make_bias_trainable(model)
        engine = dpfit.PrivacyEngine(
            model, expected_batch_size=5, sample_size=5, noise_multiplier=1.0,
            batch_first=False, insecure_seed=3, check_gradients=check,
        )  # fmt: skip
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        torch.manual_seed(11)  # dropout's stream
        for _ in range(2):
            for x, y in engine.data_loader(Data(5, 5), optimizer=opt):
                nn.functional.cross_entropy(model(x), y).backward()
                engine.step(opt)
        assert model.training
        assert engine._probe.pending is not check
        return _params(model), torch.rand(3)

    (with_probe, rng_after), (without, rng_without) = run(True), run(False)
    assert torch.equal(rng_after, rng_without)
    assert all(torch.equal(with_probe[k], without[k]) for k in with_probe)


def test_probe_is_armed_again_after_a_phase_switch():
    model = SeqFirst()
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=5, sample_size=5, noise_multiplier=1.0,
        sampling="user-poisson", batch_first=False,
    )  # fmt: skip
    data = Data(5, 5)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    nn.functional.cross_entropy(model(data.x), data.y).backward()
    engine.step(opt, batch_size=5)
    assert not engine._probe.pending
    engine.switch_phase("full")
    assert engine._probe.pending


def test_user_poisson_needs_the_batch_size():
    model = SeqFirst()
    dpfit.make_bias_trainable(model)
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=5, sample_size=50, noise_multiplier=1.0,
        sampling="user-poisson", batch_first=False,
    )  # fmt: skip
    data = Data(5, 5)
    nn.functional.cross_entropy(model(data.x), data.y).backward()
    with pytest.raises(SamplingError, match="batch_size=len"):
        engine.step(torch.optim.SGD(engine.parameters(), lr=0.1))
    assert engine.steps_taken == 0


def test_inputs_with_a_freed_graph_and_outputs_without_an_example_axis(caplog):
    """An input computed upstream (its graph freed by the user's backward) is rerun detached;
    a model whose only output is a scalar cannot be probed: a warning, and the count check."""
    model = SeqFirst()
    dpfit.make_bias_trainable(model)
    upstream = nn.Linear(6, 6)
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=5, sample_size=5, noise_multiplier=1.0,
        sampling="user-poisson", batch_first=False,
    )  # fmt: skip
    data = Data(5, 4)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    nn.functional.cross_entropy(model(upstream(data.x)), data.y).backward()
    engine.step(opt, batch_size=5)
    assert not engine._probe.pending

    class LossOut(nn.Module):  # returns the batch loss only
        def __init__(self):
            super().__init__()
            self.inner = SeqFirst()

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.inner(x), y)

    model = LossOut()
    dpfit.make_bias_trainable(model)
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=5, sample_size=5, noise_multiplier=1.0,
        sampling="user-poisson", batch_first=False,
    )  # fmt: skip
    model(data.x, data.y).backward()
    with caplog.at_level("WARNING", logger="dpfit.batch_axis"):
        engine.step(torch.optim.SGD(engine.parameters(), lr=0.1), batch_size=5)
    assert "no output of the model has an axis of examples" in caplog.text
    assert engine.steps_taken == 1

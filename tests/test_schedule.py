"""Two-phase X+BiTFiT: one ledger, composed epsilon, rebuilt optimizer, no leaked hooks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oracle import Capture
from torch import nn

import dpfit
from dpfit import PrivacyEngine
from dpfit.accounting import epsilon_for
from dpfit.errors import SamplingError
from dpfit.schedule import parse_schedule

torch.set_num_threads(1)


class Data(torch.utils.data.Dataset):
    def __init__(self, n=40):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 2))


def hook_count(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def test_two_phase_run_composes_one_ledger():
    model = make_model()
    dpfit.make_bias_trainable(model, train_head=("3",))
    selection = {n for n, p in model.named_parameters() if p.requires_grad}
    data = Data()
    engine = PrivacyEngine(
        model, expected_batch_size=10, sample_size=len(data), target_epsilon=3.0,
        target_delta=1e-5, schedule=[("full", 1), ("bias", 2)],
    )  # fmt: skip
    assert engine.mode == "full"
    assert all(p.requires_grad for p in model.parameters())
    loader = engine.data_loader(data)
    eps_after = {}
    for phase in engine.phases():
        assert engine.mode == phase.mode
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
        for _ in range(int(phase.epochs)):
            for x, y in loader:
                F.cross_entropy(model(x), y).backward()
                engine.step(opt)
        for n, before in frozen.items():  # what a phase does not train stays put
            assert torch.equal(dict(model.named_parameters())[n], before)
        eps_after[phase.mode] = engine.epsilon()
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == selection
    spe = engine.config.steps_per_epoch
    assert engine.steps_taken == 3 * spe
    composed = epsilon_for(engine.noise_multiplier, engine.sample_rate, 3 * spe, 1e-5)
    assert engine.epsilon() == pytest.approx(composed, rel=1e-9)
    assert eps_after["full"] < eps_after["bias"] <= 3.0 * 1.001
    assert eps_after["bias"] > 0.95 * 3.0  # calibrated for all phases, not for the first
    assert [r["count"] for r in engine.privacy_record()["history"]] == [3 * spe]


def test_switch_rebuilds_optimizer_and_hooks_do_not_leak():
    model = make_model()
    n_hooks = hook_count(model)
    engine = PrivacyEngine(
        model, expected_batch_size=4, sample_size=40, noise_multiplier=1.0, mode="full",
        sampling="user-poisson",
    )  # fmt: skip
    full_hooks = hook_count(model)
    opt = torch.optim.AdamW(engine.parameters(), lr=0.01, weight_decay=0.1)
    for _ in range(3):
        opt2 = engine.switch_phase("bias", opt)
        assert hook_count(model) == full_hooks  # one per hooked layer, plus the root's
        assert not any(plan.needs_input for plan in engine._plans.values())  # nothing cached
        engine.switch_phase("full")
        assert hook_count(model) == full_hooks
        assert all(plan.needs_input for plan in engine._plans.values())
    engine.switch_phase("bias")
    assert type(opt2) is torch.optim.AdamW and opt2 is not opt
    assert opt2.param_groups[0]["lr"] == 0.01 and opt2.param_groups[0]["weight_decay"] == 0.1
    assert [id(p) for p in opt2.param_groups[0]["params"]] == [id(p) for p in engine.parameters()]
    assert all(n.endswith("bias") for n, p in model.named_parameters() if p.requires_grad)
    engine.detach()
    assert hook_count(model) == n_hooks


def test_switch_mid_batch_is_refused():
    model = make_model()
    engine = PrivacyEngine(
        model, expected_batch_size=4, sample_size=40, noise_multiplier=1.0, mode="full",
    )  # fmt: skip
    loader = engine.data_loader(Data(), physical_batch_size=2)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    refused = False
    for x, y in loader:  # some logical batch has > 2 examples (P(none in 10) ~ 3e-7)
        F.cross_entropy(model(x), y).backward()
        if not engine.step(opt):
            with pytest.raises(SamplingError, match="middle of a logical batch"):
                engine.switch_phase("bias")
            refused = True
            break
    assert refused, "no logical batch spanned two physical batches: nothing was tested"
    assert engine.mode == "full"


@pytest.mark.parametrize("order", [("full", "bias"), ("bias", "full")])
def test_gradients_exact_after_switch(order):
    model = make_model().double()
    x = torch.randn(5, 6, dtype=torch.float64)
    y = torch.tensor([0, 1, 1, 0, 1])
    engine = PrivacyEngine(
        model, expected_batch_size=5, sample_size=50, noise_multiplier=0.0, mode=order[0],
        max_grad_norm=1e-4, sampling="user-poisson",
    )  # fmt: skip
    engine.switch_phase(order[1])
    params = engine.parameters()
    per = []
    for i in range(5):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        per.append([p.grad.clone() for p in params])
    model.zero_grad()
    engine._per_example.clear()  # the oracle's own passes went through the hooks too
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in gs)) for gs in per])
    c = (1e-4 / norms).clamp(max=1.0)  # min(1, R / ||g||)
    opt = Capture(params)
    F.cross_entropy(model(x), y).backward()
    engine.step(opt, batch_size=5)
    for j, p in enumerate(params):
        want = sum(c[i] * per[i][j] for i in range(5)) / 5
        assert (opt.grads[p].double() - want).norm() <= 1e-5 * want.norm() + 1e-12


def test_recalibration_meets_target_for_the_whole_run():
    model = make_model()
    q, target = 0.1, 2.0
    engine = PrivacyEngine(
        model, expected_batch_size=4, sample_size=40, noise_multiplier=1.5, mode="full",
        target_epsilon=target, sampling="user-poisson",
    )  # fmt: skip
    for _ in range(20):  # phase one, at a noise chosen by hand
        engine.ledger.record(engine.noise_multiplier, q)
    sigma1 = engine.noise_multiplier
    engine.switch_phase("bias", remaining_steps=100)
    assert engine.noise_multiplier != sigma1
    for _ in range(100):
        engine.ledger.record(engine.noise_multiplier, q)
    assert target * 0.97 < engine.ledger.epsilon() <= target * 1.001


def test_schedule_parsing():
    assert [p.mode for p in parse_schedule([("full", 0), ("bias", 3)])] == ["bias"]
    with pytest.raises(ValueError):
        parse_schedule([("lora", 1)])
    with pytest.raises(ValueError):
        parse_schedule([("full", 0)])


def test_empty_batch_after_a_switch_steps_the_new_parameters(monkeypatch):
    """After bias -> full, an empty logical batch (a noise-only step taken inside the loader)
    steps the new parameter set through the rebuilt optimizer, not the old bias optimizer
    (which would leave the weights unmoved and their noisy .grad behind)."""
    model = make_model()
    dpfit.make_bias_trainable(model)
    engine = PrivacyEngine(model, expected_batch_size=4, sample_size=40, noise_multiplier=1.0)
    assert all(n.endswith("bias") for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.SGD(engine.parameters(), lr=0.5)
    data = Data(40)
    # Poisson draws come from OS entropy, so the first phase may itself draw an empty batch
    # (0.9**40 = 1.5%): count steps from the switch, not from zero.
    for x, y in engine.data_loader(data, physical_batch_size=40, optimizer=opt):
        F.cross_entropy(model(x), y).backward()
        if engine.step(opt):
            break
    opt = engine.switch_phase("full", opt)
    steps_at_switch = engine.steps_taken
    weights = {n: p.detach().clone() for n, p in model.named_parameters() if "weight" in n}
    monkeypatch.setattr(dpfit.sampling.PoissonBatchSampler, "draw", lambda self: [])
    loader = iter(engine.data_loader(data, max_steps=engine.steps_taken + 1))
    assert next(loader, None) is None  # one empty logical batch, taken inside the loader
    assert engine.steps_taken == steps_at_switch + 1
    for n, p in model.named_parameters():
        if "weight" in n:
            assert p.grad is None, n
            assert not torch.equal(p.detach(), weights[n]), n

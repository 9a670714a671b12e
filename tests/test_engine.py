"""PrivacyEngine behaviour: clipping, noise, determinism, virtual steps, errors, resume."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from noise_check import assert_std
from oracle import Capture, make_engine, oracle_per_example
from torch import nn

import dpfit


def small_model() -> nn.Module:
    torch.manual_seed(1)
    m = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))
    dpfit.make_bias_trainable(m)
    return m


class TensorDataset(torch.utils.data.Dataset):
    def __init__(self, n: int = 40, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 5, 6, generator=g)
        self.y = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def seq_loss(model, x, y, reduction="mean"):
    return nn.functional.cross_entropy(model(x).mean(1), y, reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("clipping", ["flat", "automatic"])
def test_noiseless_update_is_sum_of_clipped_oracle_grads(reduction, clipping):
    model = small_model().double()
    data = TensorDataset(6)
    x, y = data.x.double(), data.y
    want = oracle_per_example(
        model, lambda i: seq_loss(model, x[i : i + 1], y[i : i + 1], "sum"), 6
    )
    R = 1e-3
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in want.values()))
    assert (norms > R).all()  # the clip bites on every example
    # written out, not taken from dpfit.clipping: flat min(1, R/||g||), automatic R/(||g||+0.01)
    factors = (R / norms).clamp(max=1.0) if clipping == "flat" else R / (norms + 0.01)
    assert (factors * norms <= R * (1 + 1e-12)).all()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    engine = make_engine(
        model, expected_batch_size=4, max_grad_norm=R, loss_reduction=reduction, clipping=clipping
    )
    opt = torch.optim.SGD(engine.parameters(), lr=1.0)
    seq_loss(model, x, y, reduction).backward()
    assert engine.step(opt, batch_size=len(x))
    for name, p in model.named_parameters():
        if p.requires_grad:
            expected = (factors.view(-1, *[1] * (want[name].dim() - 1)) * want[name]).sum(0) / 4
            torch.testing.assert_close(before[name] - p.detach(), expected, rtol=1e-5, atol=1e-12)


def saved_bytes(fn) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_autograd_saves_no_more_than_nonprivate_bias_only():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=2,
    )
    model = transformers.BertForSequenceClassification(cfg)
    dpfit.make_bias_trainable(model)
    ids = torch.randint(0, 100, (4, 16))
    labels = torch.randint(0, 2, (4,))

    def run():
        torch.manual_seed(0)
        model(input_ids=ids, labels=labels).loss.backward()

    plain = saved_bytes(run)
    engine = make_engine(model, loss_reduction="mean")
    private = saved_bytes(run)
    engine._per_example.clear()
    engine.detach()
    assert plain > 0
    assert private <= plain, (private, plain)


def test_noise_std_matches_sigma_R_over_B():
    model = small_model()
    sigma, R, B = 1.7, 0.5, 8
    engine = make_engine(model, expected_batch_size=B, noise_multiplier=sigma, max_grad_norm=R)
    opt = torch.optim.SGD(engine.parameters(), lr=0.0)
    x = torch.randn(2, 5, 6)
    draws = []
    opt.register_step_pre_hook(
        lambda o, a, k: draws.append(torch.cat([p.grad.flatten() for p in engine.parameters()]))
    )
    for _ in range(300):
        (model(x) * 0).sum().backward()  # zero gradients: only noise remains
        engine.step(opt, batch_size=len(x))
    assert_std(torch.stack(draws), sigma * R / B)  # chi-square bound on the sample variance


def test_secure_rng_noise_is_gaussian_with_right_scale():
    from dpfit.engine import gaussian_noise

    like = torch.zeros(1)
    z = gaussian_noise(torch.Size([200_000]), 2.0, torch.Generator(), True, like).double()
    n = z.numel()
    assert abs(z.std().item() / 2.0 - 1) < 5 / math.sqrt(2 * n)
    assert abs(z.mean().item()) < 5 * 2.0 / math.sqrt(n)
    # fourth moment of a Gaussian: 3 sigma^4 (catches a uniform or otherwise wrong shape)
    assert abs((z**4).mean().item() / (3 * 16) - 1) < 0.05


def train(
    seed: int | None,
    steps_data_seed: int = 0,
    physical=None,
    n_epochs=1,
    secure=False,
    with_optimizer=False,
):
    model = small_model()
    data = TensorDataset(40, steps_data_seed)
    engine = dpfit.PrivacyEngine(
        model,
        expected_batch_size=8,
        sample_size=40,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        insecure_seed=seed,
        secure_rng=secure,
    )
    opt = torch.optim.Adam(engine.parameters(), lr=0.01)
    loader = engine.data_loader(data, physical_batch_size=physical)
    for _ in range(n_epochs):
        for x, y in loader:
            seq_loss(model, x, y).backward()
            engine.step(opt)
    return (model, engine, opt) if with_optimizer else (model, engine)


def params_of(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_seeded_runs_repeat_exactly_and_seeds_differ():
    a, ea = train(seed=5)
    b, _ = train(seed=5)
    c, _ = train(seed=6)
    assert torch.equal(params_of(a), params_of(b))
    assert not torch.equal(params_of(a), params_of(c))
    assert ea.steps_taken == 5  # round(1/q) = 40/8 logical steps per epoch


def test_virtual_steps_equal_one_big_batch():
    """Physical batches of 2 accumulate into the same noised step as one logical batch."""
    a, _ = train(seed=9, physical=None)
    b, _ = train(seed=9, physical=2)
    torch.testing.assert_close(params_of(a), params_of(b), rtol=1e-5, atol=1e-6)


def test_empty_logical_batches_are_noise_steps():
    model = small_model()
    data = TensorDataset(40)
    engine = dpfit.PrivacyEngine(model, expected_batch_size=1, sample_size=40, noise_multiplier=1.0)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    calls = 0
    for x, y in engine.data_loader(data):
        calls += 1
        seq_loss(model, x, y).backward()
        engine.step(opt)
    assert calls < 40  # some logical batches were empty (q = 1/40)
    assert engine.steps_taken == 40  # yet every logical step was taken and accounted


def _first_draws_empty(monkeypatch, empties: int) -> None:
    """The sampler's first `empties` logical batches come out empty (through its draw seam)."""
    real = dpfit.sampling.PoissonBatchSampler.draw
    left = [empties]

    def draw(self):
        if left[0]:
            left[0] -= 1
            return []
        return real(self)

    monkeypatch.setattr(dpfit.sampling.PoissonBatchSampler, "draw", draw)


def test_empty_batches_before_the_first_step_are_applied_in_order(monkeypatch):
    """Empty logical batches drawn before any step(): with the optimizer given to the loader,
    their noise-only steps are taken at once, so the next batch's gradient is taken at the
    parameters they moved (not applied late, after that gradient)."""
    _first_draws_empty(monkeypatch, 2)
    model = small_model()
    start = [p.detach().clone() for p in model.parameters() if p.requires_grad]
    engine = dpfit.PrivacyEngine(model, expected_batch_size=8, sample_size=40, noise_multiplier=1.0)
    opt = torch.optim.SGD(engine.parameters(), lr=0.5)
    seen = []  # (steps taken, parameters) at each forward
    for x, y in engine.data_loader(TensorDataset(40), optimizer=opt):
        seen.append((engine.steps_taken, [p.detach().clone() for p in engine.parameters()]))
        seq_loss(model, x, y).backward()
        engine.step(opt)
        break
    steps, at_forward = seen[0]
    assert steps == 2
    moved = max((a - b).abs().max().item() for a, b in zip(at_forward, start, strict=True))
    assert moved > 1e-3  # two noise-only steps of std lr * sigma * R / B = 0.0625 each
    assert engine.steps_taken == 3


def test_empty_batches_before_any_optimizer_warn(monkeypatch, caplog):
    """Without the optimizer, such a step can only wait for the first step(): said once."""
    _first_draws_empty(monkeypatch, 2)
    model = small_model()
    engine = dpfit.PrivacyEngine(model, expected_batch_size=8, sample_size=40, noise_multiplier=1.0)
    opt = torch.optim.SGD(engine.parameters(), lr=0.5)
    with caplog.at_level("WARNING", logger="dpfit.engine"):
        for x, y in engine.data_loader(TensorDataset(40)):
            assert engine.steps_taken == 0
            seq_loss(model, x, y).backward()
            engine.step(opt)
            break
    assert engine.steps_taken == 3  # late, but taken and accounted
    assert sum("optimizer= to engine.data_loader" in r.message for r in caplog.records) == 1


def test_resume_from_state_dict_matches_uninterrupted():
    full_model, full_engine = train(seed=11, n_epochs=2)
    # interrupted: one epoch, save, then a fresh model/engine/optimizer resumes
    model, engine, opt = train(seed=11, n_epochs=1, with_optimizer=True)
    state = engine.state_dict()
    params = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    model2 = small_model()
    model2.load_state_dict(params)
    engine2 = dpfit.PrivacyEngine(
        model2,
        expected_batch_size=8,
        sample_size=40,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        insecure_seed=999,  # the RNG state comes from the checkpoint, not the seed
    )
    engine2.load_state_dict(state)
    opt2 = torch.optim.Adam(engine2.parameters(), lr=0.01)
    opt2.load_state_dict(opt_state)
    loader = engine2.data_loader(TensorDataset(40))
    for x, y in loader:
        seq_loss(model2, x, y).backward()
        engine2.step(opt2)
    assert engine2.steps_taken == full_engine.steps_taken
    assert engine2.epsilon() == pytest.approx(full_engine.epsilon(), rel=1e-12)
    # same noise, same batches, same optimizer state: the very same parameters
    assert torch.equal(params_of(model2), params_of(full_model))


def test_two_continuations_of_one_checkpoint_draw_fresh_noise_and_batches():
    """Default (OS-seeded) generators: a checkpoint carries no generator state, and each
    continuation draws fresh noise and batches. Restoring the state would
    make two continuations draw the same noise: the difference of their releases would be the
    noise-free difference of clipped gradients. With q = 1 and lr = 0 both continuations clip
    the same gradients, so the difference of their released updates is the difference of two
    independent noises: N(0, 2 (sigma R / B)^2) per coordinate."""
    sigma, R, B = 1.0, 1.0, 8
    model = small_model()
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=B, sample_size=B, noise_multiplier=sigma, max_grad_norm=R
    )
    opt = torch.optim.SGD(engine.parameters(), lr=0.0)
    for x, y in engine.data_loader(TensorDataset(B), optimizer=opt):
        seq_loss(model, x, y).backward()
        engine.step(opt)
    state = copy.deepcopy(engine.state_dict())
    assert state["noise_rng"] is None and state["sample_rng"] is None  # no secret in the file
    assert state["loader"]["rng"] is None
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}

    def resume() -> torch.Tensor:
        m = small_model()
        m.load_state_dict(snapshot)
        e = dpfit.PrivacyEngine(
            m, expected_batch_size=B, sample_size=B, noise_multiplier=sigma, max_grad_norm=R
        )
        e.load_state_dict(state)
        o = torch.optim.SGD(e.parameters(), lr=0.0)
        released = []
        o.register_step_pre_hook(
            lambda o_, a, k: released.append(torch.cat([p.grad.flatten() for p in e.parameters()]))
        )
        for _ in range(30):
            for x, y in e.data_loader(TensorDataset(B), optimizer=o):
                seq_loss(m, x, y).backward()
                e.step(o)
        assert e.steps_taken == 31  # the ledger goes on from the checkpoint's step
        return torch.stack(released)

    diff = resume() - resume()
    assert_std(diff, math.sqrt(2) * sigma * R / B)
    assert engine.privacy_record()["insecure_seed"] is False


def test_continuation_of_a_seeded_run_draws_the_sampling_stream_afresh():
    """q < 1: the batches of two continuations differ (fresh sampling), but not with an
    explicit insecure seed, where a resume continues the seeded streams bit-for-bit."""

    def draws(seed: int | None) -> list[list[int]]:
        model, engine = train(seed=seed, n_epochs=1)
        state = engine.state_dict()
        out = []
        for _ in range(2):
            e = dpfit.PrivacyEngine(
                small_model(), expected_batch_size=8, sample_size=40, noise_multiplier=1.0,
                insecure_seed=seed,
            )  # fmt: skip
            e.load_state_dict(state)
            loader = e.data_loader(TensorDataset(40))
            out.append([loader.sampler.draw() for _ in range(20)])
        return out

    fresh = draws(None)
    assert fresh[0] != fresh[1]
    seeded = draws(4)
    assert seeded[0] == seeded[1]


def test_loader_state_resumes_mid_epoch():
    model = small_model()
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=8, sample_size=40, noise_multiplier=1.0, insecure_seed=2
    )
    loader = engine.data_loader(TensorDataset(40))
    it = iter(loader.sampler)
    first = [next(it) for _ in range(2)]
    state = loader.state_dict()
    rest = list(it)
    loader.load_state_dict(state)
    assert list(loader.sampler) == rest
    assert len(first) + len(rest) == 5


def test_poisson_sampler_rate():
    from dpfit.sampling import PoissonBatchSampler

    s = PoissonBatchSampler(
        1000, 0.05, steps_per_epoch=200, generator=torch.Generator().manual_seed(0)
    )
    sizes = torch.tensor([len(b) for b in s], dtype=torch.float64)
    # mean of 200 Binomial(1000, 0.05): sd of the mean = sqrt(1000*.05*.95/200)
    assert abs(sizes.mean().item() - 50) < 5 * math.sqrt(1000 * 0.05 * 0.95 / 200)
    assert sizes.std().item() > 3  # sizes vary: it is not fixed-size batching


# ---------------------------------------------------------------- errors


def test_unsupported_layer_is_named():
    model = nn.Sequential(nn.Bilinear(3, 3, 2))
    dpfit.make_bias_trainable(model)
    with pytest.raises(dpfit.UnsupportedLayerError, match=r"0\.bias.*Bilinear"):
        make_engine(model)


def test_model_without_biases_points_to_add_biases():
    model = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 2, bias=False))
    with pytest.raises(dpfit.NoTrainableParametersError, match="add_biases"):
        dpfit.make_bias_trainable(model)


def test_nothing_trainable_is_an_error():
    model = nn.Linear(3, 2)
    model.requires_grad_(False)
    with pytest.raises(dpfit.NoTrainableParametersError):
        make_engine(model)


def test_budget_exhausted_before_exceeding_target():
    model = small_model()
    engine = dpfit.PrivacyEngine(
        model,
        expected_batch_size=8,
        sample_size=40,
        target_epsilon=3.0,
        target_delta=1e-5,
        epochs=1,
    )
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    data = TensorDataset(40)
    with pytest.raises(dpfit.BudgetExhaustedError, match="spent"):
        for _ in range(100):
            for x, y in engine.data_loader(data):
                seq_loss(model, x, y).backward()
                engine.step(opt)
    assert engine.steps_taken >= 5  # the planned epoch fits
    assert engine.epsilon() <= 3.0


def test_step_without_engine_loader_is_refused():
    model = small_model()
    engine = dpfit.PrivacyEngine(model, expected_batch_size=8, sample_size=40, noise_multiplier=1.0)
    x, y = TensorDataset(8).x, TensorDataset(8).y
    seq_loss(model, x, y).backward()
    with pytest.raises(dpfit.SamplingError, match="data_loader"):
        engine.step(torch.optim.SGD(engine.parameters(), lr=0.1))


def test_gradients_of_two_forward_passes_in_one_step_are_refused():
    # rows of two batches summed row by row would give one row two examples' gradients
    model = small_model()
    engine = make_engine(model)
    x1, x2 = torch.randn(3, 5, 6), torch.randn(3, 5, 6)
    (model(x1).sum() + model(x2).sum()).backward()
    with pytest.raises(dpfit.SamplingError, match="more than one forward"):
        engine.step(torch.optim.SGD(engine.parameters(), lr=0.1))


def test_shuffled_dataloader_is_refused():
    model = small_model()
    engine = dpfit.PrivacyEngine(model, expected_batch_size=8, sample_size=40, noise_multiplier=1.0)
    loader = torch.utils.data.DataLoader(TensorDataset(40), batch_size=8, shuffle=True)
    with pytest.raises(dpfit.SamplingError, match="Poisson"):
        engine.data_loader(loader)


def test_bias_used_outside_its_module_is_caught():
    class Sneaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):  # reuses the bias in a functional call the hooks cannot see
            return self.lin(x) + nn.functional.linear(x, self.lin.weight, self.lin.bias)

    model = Sneaky()
    dpfit.make_bias_trainable(model)
    engine = make_engine(model)
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(dpfit.GradientMismatchError, match="do not add up"):
        engine.step(torch.optim.SGD(engine.parameters(), lr=0.1), batch_size=3)


def test_wrong_batch_axis_is_caught():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    dpfit.make_bias_trainable(model)
    engine = make_engine(model, batch_dims={"1": 1})
    model(torch.randn(3, 5, 4)).sum().backward()
    with pytest.raises(dpfit.GradientMismatchError, match="batch"):
        engine.step(torch.optim.SGD(engine.parameters(), lr=0.1), batch_size=3)


def test_infeasible_target_is_an_error():
    with pytest.raises(dpfit.InfeasibleTargetError):
        dpfit.noise_multiplier_for(1e-4, 1e-5, 1.0, 10**6)


def test_detach_leaves_model_as_before():
    model = small_model()
    hooks_before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [p.requires_grad for p in model.parameters()]
    engine = make_engine(model)
    engine.detach()
    assert [
        (len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()
    ] == hooks_before
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert [p.requires_grad for p in model.parameters()] == flags
    assert not any(k.startswith("_dpfit") for p in model.parameters() for k in vars(p))


def test_broadcast_input_gets_a_specific_error():
    class Pos(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(5, 4)
            self.lin = nn.Linear(4, 2)

        def forward(self, x):  # position embeddings of shape (1, T), broadcast over the batch
            return self.lin(x + self.pos(torch.arange(x.shape[1]).unsqueeze(0)))

    model = Pos()
    engine = make_engine(model, mode="full")
    model(torch.randn(3, 5, 4)).sum().backward()
    with pytest.raises(dpfit.GradientMismatchError, match="broadcast"):
        engine.step(torch.optim.SGD(engine.parameters(), lr=0.1), batch_size=3)


# ---------------------------------------------------------------- randomness


class Indexed(torch.utils.data.Dataset):
    """TensorDataset that also returns each example's index, to see which batches were drawn."""

    def __init__(self, n: int = 40) -> None:
        self.inner = TensorDataset(n)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return (*self.inner[i], i)


def draws(**engine_kw) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Build an engine as a user with a fixed public seed would, run one epoch; return the
    logical batches drawn and the noised gradients released."""
    torch.manual_seed(0)  # the public seed: model init, data, everything non-private
    model = small_model()
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=8, sample_size=40, noise_multiplier=1.0, **engine_kw
    )
    opt = Capture(engine.parameters())
    batches, released = [], []
    for x, y, idx in engine.data_loader(Indexed(40)):
        (seq_loss(model, x, y) * 0).sum().backward()
        if engine.step(opt):
            batches.append(idx.tolist())
            released.append(torch.cat([opt.grads[p].flatten() for p in engine.parameters()]))
    return batches, released


def test_seed_keyword_is_gone():
    with pytest.raises(TypeError, match="seed"):
        dpfit.PrivacyEngine(
            small_model(), expected_batch_size=8, sample_size=40, noise_multiplier=1.0, seed=0
        )


def test_noise_and_batches_are_not_reproducible_by_default():
    """Same public seed, config and data: a second run must not regenerate the first one's
    noise or batches (else anyone who knows the seed subtracts the noise)."""
    b1, n1 = draws()
    b2, n2 = draws()
    assert b1 != b2
    assert all(not torch.equal(a, b) for a, b in zip(n1, n2, strict=False))


def test_insecure_seed_reproduces_and_is_recorded(caplog):
    with caplog.at_level("WARNING", logger="dpfit.engine"):
        b1, n1 = draws(insecure_seed=7)
    assert "NOT differentially private" in caplog.text
    b2, n2 = draws(insecure_seed=7)
    b3, n3 = draws(insecure_seed=8)
    assert b1 == b2 and all(torch.equal(a, b) for a, b in zip(n1, n2, strict=True))
    assert b1 != b3 and not torch.equal(n1[0], n3[0])
    model = small_model()
    rec = dpfit.PrivacyEngine(
        model, expected_batch_size=8, sample_size=40, noise_multiplier=1.0, insecure_seed=7
    ).privacy_record()
    assert rec["insecure_seed"] is True
    rec = dpfit.PrivacyEngine(
        model, expected_batch_size=8, sample_size=40, noise_multiplier=1.0
    ).privacy_record()
    assert rec["insecure_seed"] is False


def test_insecure_seed_gives_distinct_noise_and_sampling_streams():
    from dpfit.rng import make_generator

    a = torch.rand(100, generator=make_generator(3, "noise"))
    b = torch.rand(100, generator=make_generator(3, "sampling"))
    assert not torch.equal(a, b)


def test_insecure_seed_with_secure_rng_is_refused():
    with pytest.raises(ValueError, match="secure_rng"):
        dpfit.PrivacyEngine(
            small_model(), expected_batch_size=8, sample_size=40, noise_multiplier=1.0,
            secure_rng=True, insecure_seed=1,
        )  # fmt: skip


class UrandomMeter:
    """Stands in for os.urandom: counts bytes, and replays a fixed stream when told to."""

    def __init__(self, real, fixed: bool = False) -> None:
        self.real, self.fixed, self.bytes = real, fixed, 0
        self.stream = __import__("random").Random(1234)

    def __call__(self, n: int) -> bytes:
        self.bytes += n
        return self.stream.randbytes(n) if self.fixed else self.real(n)


def test_secure_rng_engine_draws_every_step_from_os_urandom(monkeypatch):
    """The engine's loader and noise (not only gaussian_noise) take their randomness from
    os.urandom at each step: 8 bytes per inclusion decision and per noise coordinate."""
    import os

    meter = UrandomMeter(os.urandom)
    monkeypatch.setattr(os, "urandom", meter)
    model = small_model()
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=8, sample_size=40, noise_multiplier=1.0, secure_rng=True
    )
    d = sum(p.numel() for p in engine.parameters())
    opt = Capture(engine.parameters())
    start = meter.bytes
    for x, y in engine.data_loader(TensorDataset(40)):
        seq_loss(model, x, y).backward()
        engine.step(opt)
    steps = engine.steps_taken
    assert steps == 5
    per_step = (meter.bytes - start) / steps
    assert per_step >= 8 * 40 + 8 * d, per_step

    # and nothing else is random: with os.urandom replaced by a fixed stream, two secure runs
    # coincide (no torch generator was consulted)
    monkeypatch.setattr(os, "urandom", UrandomMeter(os.urandom, fixed=True))
    b1, n1 = draws(secure_rng=True)
    monkeypatch.setattr(os, "urandom", UrandomMeter(os.urandom, fixed=True))
    b2, n2 = draws(secure_rng=True)
    assert b1 == b2 and all(torch.equal(a, b) for a, b in zip(n1, n2, strict=True))


def test_default_rng_is_seeded_from_os_urandom(monkeypatch):
    import os

    monkeypatch.setattr(os, "urandom", UrandomMeter(os.urandom, fixed=True))
    b1, n1 = draws()
    monkeypatch.setattr(os, "urandom", UrandomMeter(os.urandom, fixed=True))
    b2, n2 = draws()
    assert b1 == b2 and torch.equal(n1[0], n2[0])


# ---------------------------------------------------------------- batch axis


class SeqFirst(nn.Module):
    """Takes (B, T, D) batches from the loader, runs its layers sequence-first (T, B, D)."""

    def __init__(self, layer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        if layer == "transformer":
            self.body = nn.TransformerEncoderLayer(6, 2, 12, dropout=0.0, batch_first=False)
        else:
            self.body = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.body(x.transpose(0, 1))  # (T, B, D): every layer agrees on axis 1
        return self.head(h).mean(0)


@pytest.mark.parametrize(
    "layer,error",
    [
        # every layer sees the batch on axis 1: gradients add up and agree, yet rows are
        # positions; only the loader's batch size tells
        ("linear", dpfit.errors.BatchAxisError),
        # nn.MultiheadAttention knows its own batch axis, so the rows disagree
        ("transformer", dpfit.GradientMismatchError),
    ],
)
def test_sequence_first_model_with_batch_first_default_is_caught(layer, error):
    model = SeqFirst(layer)
    dpfit.make_bias_trainable(model)
    engine = dpfit.PrivacyEngine(model, expected_batch_size=8, sample_size=40, noise_multiplier=1)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    with pytest.raises(error, match="batch_first"):
        for x, y in engine.data_loader(TensorDataset(40), physical_batch_size=4):
            nn.functional.cross_entropy(model(x), y).backward()
            engine.step(opt)  # T = 5 positions, at most 4 examples per physical batch
    # declared correctly, the same model trains
    model = SeqFirst(layer)
    dpfit.make_bias_trainable(model)
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=8, sample_size=40, noise_multiplier=1,
        batch_first=False,
    )  # fmt: skip
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    for x, y in engine.data_loader(TensorDataset(40), physical_batch_size=4):
        nn.functional.cross_entropy(model(x), y).backward()
        engine.step(opt)
    assert engine.steps_taken == 5


def test_user_poisson_step_checks_a_given_batch_size():
    model = SeqFirst("linear")
    dpfit.make_bias_trainable(model)
    engine = make_engine(model)
    x, y = TensorDataset(3).x, TensorDataset(3).y
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    with pytest.raises(dpfit.errors.BatchAxisError, match="batch_dims"):
        engine.step(torch.optim.SGD(engine.parameters(), lr=0.1), batch_size=3)

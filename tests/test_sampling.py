"""The engine's own loader: the rate it samples at is the rate the ledger accounts; each
logical step (empty ones too) releases clipped sum + noise over the EXPECTED batch size."""

from __future__ import annotations

import math

import pytest
import torch
from noise_check import assert_std
from oracle import Capture
from torch import nn
from toy_data import Points

import dpfit
from dpfit.sampling import LogicalBatch, PoissonBatchSampler, PoissonDataLoader, RankPart


def make_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    dpfit.make_bias_trainable(model)
    return model


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, reduction: str = "mean"):
    return nn.functional.cross_entropy(model(x), y, reduction=reduction)


# ------------------------------------------------------------------ rate


def test_engine_loader_samples_at_the_accounted_rate():
    """Mean logical batch == B = qN (statistically) and the ledger records that same q."""
    N, B, epochs = 200, 20, 40
    model = make_model()
    engine = dpfit.PrivacyEngine(model, expected_batch_size=B, sample_size=N, noise_multiplier=1.0)
    opt = torch.optim.SGD(engine.parameters(), lr=0.0)
    loader = engine.data_loader(Points(N), physical_batch_size=16)
    sizes, current = [], 0
    for _ in range(epochs):
        for x, y, _idx in loader:
            current += len(x)
            loss_of(model, x, y).backward()
            if engine.step(opt):
                sizes.append(current)
                current = 0
    steps = engine.steps_taken
    assert steps == epochs * round(N / B)
    empty = steps - len(sizes)  # empty logical batches are steps with no forward pass
    sizes = torch.tensor(sizes + [0] * empty, dtype=torch.float64)
    q = B / N
    # mean of `steps` Binomial(N, q) draws: sd sqrt(N q (1-q) / steps); 5 sd is ~1e-6 two-sided
    sd = math.sqrt(N * q * (1 - q) / steps)
    assert abs(sizes.mean().item() - B) < 5 * sd, (sizes.mean().item(), B, sd)
    assert sizes.std().item() > 0.5 * math.sqrt(N * q * (1 - q))  # Poisson, not fixed size
    assert engine.sample_rate == q
    assert [r.sample_rate for r in engine.ledger.records] == [q]
    assert engine.privacy_record()["sample_rate"] == q


@pytest.mark.parametrize("secure", [False, True])
def test_sampler_rate(secure):
    s = PoissonBatchSampler(500, 0.04, steps_per_epoch=200, secure=secure)
    sizes = torch.tensor([len(b) for b in s], dtype=torch.float64)
    sd = math.sqrt(500 * 0.04 * 0.96 / 200)
    assert abs(sizes.mean().item() - 20) < 5 * sd
    assert s.position == 0 and len(s) == 200


def test_sampler_without_generator_is_os_seeded():
    a = PoissonBatchSampler(1000, 0.1).draw()
    b = PoissonBatchSampler(1000, 0.1).draw()
    assert a != b


def _ranks(world: int, secure: bool = False, seed: int = 3) -> list[PoissonBatchSampler]:
    """The samplers of a data-parallel job's ranks, as the engine builds them: one common
    generator state, or (secure) rank 0's draw handed to the others."""
    handed: list[torch.Tensor] = []

    def share(idx):  # ranks draw in rank order here: rank 0 first, the others read its draw
        if idx is not None:
            handed.append(idx)
            return idx
        return handed[-1]

    return [
        PoissonBatchSampler(
            1000,
            0.1,
            generator=None if secure else torch.Generator().manual_seed(seed),
            secure=secure,
            part=RankPart(r, world, share),
        )
        for r in range(world)
    ]


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("world", [2, 3])
def test_rank_parts_split_one_poisson_sample_evenly(world, secure):
    """The ranks' parts are disjoint, their union is the one-process draw (same generator
    state), and no part is larger than another by more than one example."""
    ranks = _ranks(world, secure)
    single = PoissonBatchSampler(1000, 0.1, generator=torch.Generator().manual_seed(3))
    for _ in range(20):
        parts = [s.draw() for s in ranks]
        union = sorted(i for p in parts for i in p)
        assert len(union) == len(set(union))
        if not secure:
            assert union == single.draw()
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1, sizes
        assert len(union) > 50


def test_a_rank_part_needs_a_common_source():
    with pytest.raises(ValueError, match="share"):
        PoissonBatchSampler(10, 0.5, secure=True, part=RankPart(0, 2))
    with pytest.raises(ValueError, match="generator"):
        PoissonBatchSampler(10, 0.5, part=RankPart(0, 2))
    with pytest.raises(ValueError, match="outside"):
        RankPart(2, 2)


class Recorder:
    """A LogicalBatchEvents that only records: the loader needs no engine."""

    def __init__(self) -> None:
        self.log: list = []

    def begin(self, batch: LogicalBatch) -> None:
        self.log.append(("begin", batch))

    def end(self) -> None:
        self.log.append(("end", None))

    def empty(self) -> None:
        self.log.append(("empty", None))


def test_loader_reports_logical_batches_and_their_chunks():
    events = Recorder()
    sampler = PoissonBatchSampler(30, 0.3, steps_per_epoch=40)
    loader = PoissonDataLoader(events, Points(30), sampler, physical_batch_size=4)
    batches = []
    for x, _, idx in loader:
        batches.append(len(x))
        assert len(idx) == len(x)
    begun = [b for kind, b in events.log if kind == "begin"]
    assert [k for k, _ in events.log].count("end") == len(begun)
    assert len(begun) + [k for k, _ in events.log].count("empty") == 40
    assert [c for b in begun for c in b.chunk_sizes] == batches
    for b in begun:
        assert sum(b.chunk_sizes) == b.size and len(b.chunk_sizes) == b.physical_batches
        assert all(c <= 4 for c in b.chunk_sizes)


def test_logical_batch_comes_in_index_order_across_its_chunks():
    """Tasks sort their items by length and rely on this order for cheap padding."""
    gen = torch.Generator().manual_seed(0)
    sampler = PoissonBatchSampler(200, 0.3, steps_per_epoch=10, generator=gen, part=RankPart(1, 2))
    events = Recorder()
    loader = PoissonDataLoader(events, Points(200), sampler, physical_batch_size=7)
    chunks = [idx.tolist() for _, _, idx in loader]
    sizes = [b.size for kind, b in events.log if kind == "begin"]
    assert sum(sizes) == sum(len(c) for c in chunks) > 50
    flat = [i for c in chunks for i in c]
    for size in sizes:
        batch, flat = flat[:size], flat[size:]
        assert batch == sorted(batch) and len(set(batch)) == size


def test_sampling_does_not_import_the_engine():
    import ast
    import inspect

    import dpfit.sampling

    tree = ast.parse(inspect.getsource(dpfit.sampling))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert "dpfit.engine" not in imported


# ------------------------------------------------------------------ noiseless loader step


def per_example_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[n, d] raw per-example gradients of the trainable parameters, one example at a time."""
    rows = []
    params = [p for p in model.parameters() if p.requires_grad]
    for i in range(len(x)):
        model.zero_grad()
        loss_of(model, x[i : i + 1], y[i : i + 1], "sum").backward()
        rows.append(torch.cat([p.grad.flatten() for p in params]))
    model.zero_grad()
    return torch.stack(rows).double()


@pytest.mark.parametrize("physical", [None, 3])
def test_noiseless_loader_step_is_clipped_sum_over_expected_batch_size(physical):
    """sigma = 0: each released update is sum_i min(1, R/||g_i||) g_i / B with B the EXPECTED
    batch size, whatever the Poisson draw's actual size (which varies from step to step).
    float64 throughout: a float32 sum of clipped rows can cancel to a coordinate near zero whose
    rounding error is far over 1e-5 of itself, whichever examples the OS-seeded draw picked."""
    N, B, R = 40, 8, 0.05
    model, twin = make_model().double(), make_model().double()
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=B, sample_size=N, noise_multiplier=0.0, max_grad_norm=R
    )
    params = engine.parameters()
    opt = Capture(params)
    data = Points(N)
    data.x = data.x.double()
    batch, actual_sizes = [], set()
    for _ in range(2):
        for x, y, idx in engine.data_loader(data, physical_batch_size=physical):
            batch += idx.tolist()
            loss_of(model, x, y).backward()
            if not engine.step(opt):
                continue
            g = per_example_grads(twin, data.x[batch], data.y[batch])
            norms = g.norm(dim=1)
            assert (norms > R).all()  # the clip bites
            c = torch.clamp(R / norms, max=1.0)  # written out: flat clipping
            want = (c[:, None] * g).sum(0) / B
            got = torch.cat([opt.grads[p].flatten() for p in params]).double()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-12)
            actual_sizes.add(len(batch))
            batch = []
    assert actual_sizes - {B}, "no step had a batch size other than B: the test proves nothing"


# ------------------------------------------------------------------ noise where nothing flows


def test_empty_logical_batches_release_full_noise():
    """With q = 1/40 about a third of the logical batches are empty; each is still a step that
    adds N(0, (sigma R / B)^2) to every coordinate."""
    N, sigma, R = 40, 2.0, 0.7
    model = make_model()
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=1, sample_size=N, noise_multiplier=sigma, max_grad_norm=R
    )
    params = engine.parameters()
    released = []  # (came from a forward pass?, update)
    in_step = [False]
    opt = Capture(params)
    real_step = opt.step

    def step(closure=None):
        real_step(closure)
        released.append((in_step[0], torch.cat([opt.grads[p].flatten() for p in params])))

    opt.step = step
    loader = engine.data_loader(Points(N))
    for _ in range(6):
        for x, y, _ in loader:
            (loss_of(model, x, y) * 0).backward()  # zero gradients: only noise is released
            in_step[0] = True
            engine.step(opt)
            in_step[0] = False
    assert engine.steps_taken == 6 * N
    empty = [u for from_step, u in released if not from_step]
    assert len(empty) > 30
    assert_std(torch.stack(empty), sigma * R / 1)


def test_parameter_without_gradient_still_gets_noise():
    """A trainable bias the forward did not use this step has no per-example gradient; its
    released update must still carry noise (else its silence says which branch ran)."""

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 3)
            self.b = nn.Linear(4, 3)

        def forward(self, x):
            return self.a(x)  # head b is idle

    torch.manual_seed(0)
    model = TwoHeads()
    dpfit.make_bias_trainable(model)
    sigma, R, B = 1.3, 0.5, 4
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=B, sample_size=100, noise_multiplier=sigma, max_grad_norm=R,
        sampling="user-poisson",
    )  # fmt: skip
    opt = Capture(engine.parameters())
    draws = []
    for _ in range(200):
        loss_of(model, torch.randn(B, 4), torch.randint(0, 3, (B,))).backward()
        engine.step(opt, batch_size=B)
        draws.append(opt.grads[model.b.bias].clone())
    assert_std(torch.stack(draws), sigma * R / B)


def test_loader_stops_at_max_steps_even_mid_pass():
    """Every rank of a distributed job stops at the same logical step (empty ones count)."""
    model = make_model()
    engine = dpfit.PrivacyEngine(model, expected_batch_size=2, sample_size=40, noise_multiplier=1.0)
    opt = torch.optim.SGD(engine.parameters(), lr=0.0)
    loader = engine.data_loader(Points(40), max_steps=7)
    for x, y, _ in loader:
        loss_of(model, x, y).backward()
        engine.step(opt)
    assert engine.steps_taken == 7 < len(loader)

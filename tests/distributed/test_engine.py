"""The engine on a gloo process group of 2 ranks (one OS process each) against 1 process.

One job runs every scenario once per rank (see dist_worker.py); the world-size-1 references
run in this process.
"""

from __future__ import annotations

import dist_worker
import dp_accounting
import pytest
import torch
from conftest import launch, results
from noise_check import ALPHA, assert_std
from scipy import stats

import dpfit

UPDATES = ["update:bias:plain", "update:bias:ddp", "update:full:plain", "update:full:ddp"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    # a one-process engine's state, with its loader's (rank 0's) sampler state in it; seeded:
    # only an insecure-seeded run continues its streams on resume
    engine = dpfit.PrivacyEngine(
        dist_worker.make_model(), expected_batch_size=32, sample_size=64, noise_multiplier=1.0,
        insecure_seed=5,
    )  # fmt: skip
    engine.data_loader(dist_worker.Points(64))
    torch.save(engine.state_dict(), out / "state.pt")
    resumed = f"resumed_streams:{out / 'state.pt'}"
    codes = launch(out, 2, *UPDATES, "noise", "streams", "streams:secure", resumed)
    assert codes == [0, 0], launch.logs
    return results(out, 2)


@pytest.mark.parametrize("spec", UPDATES)
def test_two_ranks_give_the_one_rank_update(job, spec):
    """sigma=0, a fixed logical batch split unevenly (3 vs 2 physical batches per rank)."""
    _, mode, wrap = spec.split(":")
    start = dist_worker.flat_params(dist_worker.make_model(mode))
    ref = dist_worker.update(1, mode, False)["params"] - start
    assert ref.norm() > 0
    for rank in (0, 1):
        got = job[rank][spec]
        assert got["steps"] == 3
        delta = got["params"] - start
        assert (delta - ref).norm() <= 1e-6 * ref.norm(), (rank, spec)


def test_noise_is_added_exactly_once_across_ranks(job):
    """Zero gradients: each update is N(0, (sigma R / B)^2) per coordinate, for 1 and 2 ranks
    (noise on every rank would show sqrt(2) too much)."""
    std = 1.0 * 1.0 / 16
    assert_std(job[0]["noise"]["deltas"], std)
    assert_std(dist_worker.noise(1, epochs=6)["deltas"], std)


def test_parameters_are_identical_on_every_rank_after_noisy_steps(job):
    a, b = job[0]["noise"], job[1]["noise"]
    assert a["steps"] == b["steps"] == 48
    assert torch.equal(a["params"], b["params"])
    assert torch.equal(a["deltas"], b["deltas"])
    assert a["deltas"].abs().sum() > 0


def test_epsilon_is_the_single_process_figure(job):
    a, b = job[0]["noise"], job[1]["noise"]
    acc = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(1.0))
    acc.compose(event, 48)
    expected = acc.get_epsilon(1e-5)
    assert a["epsilon"] == b["epsilon"]
    assert a["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert a["record"]["history"] == b["record"]["history"]


def test_the_union_of_rank_parts_is_poisson_at_q(job):
    """No example twice in one logical batch, each drawn w.p. q, and the ranks' parts
    differ by at most one example (no rank waits on a larger share)."""
    n, q, steps = 64, 0.25, 48
    d0, d1 = job[0]["noise"]["drawn"], job[1]["noise"]["drawn"]
    total = 0
    for t in range(1, steps + 1):
        a, b = d0.get(t, []), d1.get(t, [])
        union = a + b
        assert len(union) == len(set(union)), f"an example drawn twice in step {t}"
        assert abs(len(a) - len(b)) <= 1, (t, len(a), len(b))
        total += len(union)
    trials = n * steps
    lo, hi = stats.binom.ppf(ALPHA / 2, trials, q), stats.binom.ppf(1 - ALPHA / 2, trials, q)
    assert lo <= total <= hi, (total, lo, hi)


def _assert_parts_of(parts: list[list[int]], whole: list[int]) -> None:
    """Rank r holds every second example of the global sample, starting at its r-th."""
    assert parts[0] == whole[0::2] and parts[1] == whole[1::2], (parts, whole)


def test_ranks_split_the_one_process_sample(job):
    """With one insecure seed, the two ranks' parts are exactly the one-process draws: the
    global sample is drawn once (not once per rank, which would draw examples twice)."""
    single = dist_worker.streams(1)["draws"]
    for t, whole in enumerate(single):
        _assert_parts_of([job[0]["streams"]["draws"][t], job[1]["streams"]["draws"][t]], whole)


def test_secure_draws_are_shared_from_rank_0(job):
    """secure_rng keeps no generator the ranks could share: rank 0's draw is handed over."""
    a, b = job[0]["streams:secure"]["draws"], job[1]["streams:secure"]["draws"]
    sizes = 0
    for x, y in zip(a, b, strict=True):
        assert not set(x) & set(y) and abs(len(x) - len(y)) <= 1
        _assert_parts_of([x, y], sorted(x + y))
        sizes += len(x) + len(y)
    trials = 20 * 64  # q = 32 / 64
    lo, hi = stats.binom.ppf(ALPHA / 2, trials, 0.5), stats.binom.ppf(1 - ALPHA / 2, trials, 0.5)
    assert lo <= sizes <= hi, (sizes, lo, hi)


def test_resumed_ranks_continue_the_checkpointed_stream(job):
    """A one-process checkpoint resumed on 2 ranks: their parts are the draws the one process
    would make next (the stream is restored on every rank, not forked per rank)."""
    spec = next(k for k in job[0] if k.startswith("resumed_streams"))
    single = dist_worker.resumed_streams(1, spec.split(":", 1)[1])["draws"]
    for t, whole in enumerate(single):
        _assert_parts_of([job[0][spec]["draws"][t], job[1][spec]["draws"][t]], whole)

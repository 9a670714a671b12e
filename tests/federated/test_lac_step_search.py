"""DP-LAC with a public step search (``lac-step``): the server applies the released noised sum
scaled by the step with the lowest public validation loss, the noise drawn is the noise
accounted, and the ledger (the vote once, the update sum each round, nothing for the search)
matches an independent dp-accounting composition."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting import rdp

from dpfit.federated.clipping import ClipConfig, RoundObservation, make_clip_rule
from dpfit.federated.clipping.lac_step_search import STEPS
from dpfit.federated.clipping.lac_two_sided import FACTORS
from dpfit.federated.strategy import ClientReply, DPFedAvgServer, ServerConfig

EPS, DELTA, N, M, T = 4.0, 1e-5, 200, 20.0, 12
VOTE_SHARE = 0.1
TARGET = np.array([0.3, -0.2, 0.1, 0.05], dtype=np.float32)  # the validation loss's minimum


def _cfg(**kw) -> ServerConfig:
    base = dict(
        method="lac-step", num_clients=N, clients_per_round=M, rounds=T, target_epsilon=EPS,
        delta=DELTA, insecure_seed=0, vote_budget_share=VOTE_SHARE,
    )  # fmt: skip
    return ServerConfig(**dict(base, **kw))


def _val(params) -> tuple[float, float]:
    """A public validation loss with its minimum at TARGET."""
    return float(np.sum((params[0] - TARGET) ** 2)), 0.5


def _server(evaluate=_val, **kw) -> DPFedAvgServer:
    server = DPFedAvgServer(_cfg(**kw), [np.zeros(4, np.float32)], evaluate)
    k = len(server.rule.candidates())
    server.initialise([[1 if j == 3 else 0 for j in range(k)] for _ in range(N)])  # C_0 = C_init
    return server


class _Recording:
    """The server's noise generator, keeping every Gaussian draw it makes."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng, self.draws = rng, []

    def normal(self, loc=0.0, scale=1.0, size=None):
        draw = self.rng.normal(loc, scale, size)
        self.draws.append(draw)
        return draw


def _round(server: DPFedAvgServer, rng: np.random.Generator, scale: float = 1.0):
    sampled = server.sample_clients(list(range(N)))
    replies = [
        ClientReply(n, update=[(scale * rng.normal(size=4)).astype(np.float32)]) for n in sampled
    ]
    return server.aggregate(sampled, replies)


def test_the_vote_spans_both_sides_and_c_stays_at_c0():
    cfg = ClipConfig(initial_clip=2.0, noise_multiplier=1.0, expected_clients=M, total_rounds=T)
    rule = make_clip_rule("lac-step", cfg)
    assert rule.candidates() == pytest.approx([2.0 * f for f in FACTORS])
    assert rule.vote_trial_multiplier() == pytest.approx(math.sqrt(T))  # the run's noise
    obs = RoundObservation(update_norms=(0.01,) * 20, val_loss=9.0)
    assert rule.observe(obs, np.random.default_rng(0)) == 2.0


def test_the_applied_step_is_the_scale_with_the_lowest_validation_loss():
    """Each round: the model moves by exactly s x the released average, s in STEPS the one
    whose model has the lowest public validation loss (recomputed here from the sum)."""
    server = _server(noise_multiplier=0.5)
    rng = np.random.default_rng(1)
    seen = set()
    for _ in range(T):
        before = server.params[0].copy()
        server.noise_rng = _Recording(np.random.default_rng(len(seen) + 10))
        record = _round(server, rng, scale=0.4)
        noised = server.noise_rng.draws
        moved = server.params[0] - before
        # the released average: (clipped sum + noise) / m; rebuild it from the move
        average = moved / (server.config.server_lr * record.server_step)
        losses = {s: _val([before + (s * average).astype(np.float32)])[0] for s in STEPS}
        assert record.server_step == min(STEPS, key=lambda s: (losses[s], -s))
        assert record.val_loss == pytest.approx(_val(server.params)[0], rel=1e-6)
        seen.add(record.server_step)
        assert len(noised) == 1  # one noise draw a round, whatever the search tries
    assert len(seen) > 1  # the check saw the search choose, not one constant step


def test_without_a_search_the_model_is_what_the_fixed_rule_makes():
    """A validation loss that cannot tell the steps apart keeps the full step (a tie keeps
    the larger), and then the model is the fixed rule's at C = C_0, draw for draw: the search
    adds no randomness and changes nothing else."""

    def prefers_full(params) -> tuple[float, float]:
        return 1.0, 0.5

    a = _server(evaluate=prefers_full, noise_multiplier=0.7)
    b = DPFedAvgServer(
        _cfg(method="fixed", noise_multiplier=0.7, initial_clip=a.rule.clip_norm),
        [np.zeros(4, np.float32)],
        prefers_full,
    )
    b.initialise(None)
    b.noise_rng = np.random.default_rng(123)
    a.noise_rng = np.random.default_rng(123)
    a.sampling_rng, b.sampling_rng = np.random.default_rng(7), np.random.default_rng(7)
    for k in range(4):
        ra, rb = _round(a, np.random.default_rng(k)), _round(b, np.random.default_rng(k))
        assert ra.server_step == 1.0 and rb.server_step == 1.0
        np.testing.assert_array_equal(a.params[0], b.params[0])


def _rdp_epsilon(event: dpa.DpEvent) -> float:
    acc = rdp.RdpAccountant()
    acc.compose(event)
    return acc.get_epsilon(DELTA)


def _independent_vote_sigma() -> float:
    """The Gaussian (sensitivity 1) that alone spends VOTE_SHARE of EPS: bisection here."""
    lo, hi = 0.1, 1e3
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        spent = _rdp_epsilon(dpa.GaussianDpEvent(mid))
        lo, hi = (mid, hi) if spent > VOTE_SHARE * EPS else (lo, mid)
    return hi


def test_epsilon_matches_an_independent_dp_accounting_composition():
    server = _server()
    rng = np.random.default_rng(5)
    for _ in range(T):
        _round(server, rng)
    z, sigma_h = server.noise_multiplier, _independent_vote_sigma()
    assert server.round_multipliers == (z,)  # the whole round's budget on the update
    rounds = dpa.PoissonSampledDpEvent(M / N, dpa.GaussianDpEvent(z))
    direct = dpa.ComposedDpEvent([dpa.GaussianDpEvent(sigma_h), dpa.SelfComposedDpEvent(rounds, T)])
    eps = server.accountant.epsilon()
    assert eps == pytest.approx(_rdp_epsilon(direct), rel=1e-3)
    assert eps == pytest.approx(EPS, rel=1e-3)
    assert server.accountant.one_offs == [pytest.approx(sigma_h, rel=1e-3)]
    assert len(server.accountant.rounds) == T


def test_update_noise_drawn_is_the_noise_accounted():
    """The noise on the sum has std z C, z the update multiplier the ledger records."""
    server = DPFedAvgServer(_cfg(), [np.zeros(20_000, np.float32)], lambda p: (1.0, 0.5))
    k = len(server.rule.candidates())
    server.initialise([[1 if j == 3 else 0 for j in range(k)] for _ in range(N)])
    server.noise_rng = _Recording(np.random.default_rng(3))
    for _ in range(3):
        server.aggregate([], [])
    (z,) = server.accountant.rounds[-1]
    assert z == server.noise_multiplier
    draws = np.concatenate(server.noise_rng.draws)
    assert draws.size == 60_000
    assert np.std(draws) == pytest.approx(z * server.rule.clip_norm, rel=0.02)

"""Two-sided DP-LAC (``lac-2s``): its moves on synthetic norms and losses, and its privacy
ledger against an independent dp-accounting computation and the noise actually drawn."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting import rdp

from dpfit.federated.clipping import (
    ClipConfig,
    LacClip,
    RoundObservation,
    TwoSidedLacClip,
    make_clip_rule,
)
from dpfit.federated.clipping.lac_two_sided import BAND, FACTORS, RISE, band_step
from dpfit.federated.strategy import ClientReply, DPFedAvgServer, ServerConfig

EPS, DELTA, N, M, T = 4.0, 1e-5, 200, 20.0, 12
VOTE_SHARE, COUNT_SHARE = 0.1, 0.1


def _rule(c_init: float = 1.0, z: float = 1.0, m: float = M, rounds: int = T) -> TwoSidedLacClip:
    cfg = ClipConfig(
        initial_clip=c_init, noise_multiplier=z, expected_clients=m, total_rounds=rounds
    )
    return make_clip_rule("lac-2s", cfg)


INSIDE = [0.8] * 14 + [2.0] * 6  # 70% unclipped at C = 1: inside the band


def _obs(norms, loss) -> RoundObservation:
    return RoundObservation(update_norms=tuple(norms), val_loss=loss)


# -- the vote ---------------------------------------------------------------------------------


def test_vote_spans_both_sides_of_c_init_and_dp_lac_is_unchanged():
    rule = _rule(c_init=2.0)
    assert isinstance(rule, TwoSidedLacClip)
    assert rule.candidates() == pytest.approx([2.0 * f for f in FACTORS])
    assert min(rule.candidates()) == pytest.approx(0.2) and max(rule.candidates()) == 20.0
    lac = make_clip_rule("lac", ClipConfig(initial_clip=2.0, noise_multiplier=1.0))
    assert isinstance(lac, LacClip)
    assert lac.candidates() == [0.5, 1.0, 2.0]  # the paper's grid
    assert lac.vote_trial_multiplier() == lac.update_multiplier  # the paper's objective


def test_vote_trial_noise_is_the_run_s_accumulated_noise():
    rule = _rule(z=1.3, rounds=25)
    assert rule.vote_trial_multiplier() == pytest.approx(rule.update_multiplier * 5.0)
    server = DPFedAvgServer(_cfg(rounds=25), [np.zeros(3, np.float32)])
    query = server.vote_query_config()
    assert query["noise_multiplier"] == pytest.approx(server.rule.update_multiplier * 5.0)
    assert query["candidates"] == pytest.approx(list(FACTORS))


# -- the band -----------------------------------------------------------------------------


def test_band_grows_when_most_updates_are_clipped_and_shrinks_when_none_are():
    low, high = BAND
    assert band_step(1.0, 0.0, 0.0) == pytest.approx(2.0)  # all clipped: x2
    assert 1.0 < band_step(1.0, low / 2, 0.0) < 2.0
    assert band_step(1.0, 1.0, 0.0) == pytest.approx(0.5)  # none clipped: /2
    for inside in (low, (low + high) / 2, high):
        assert band_step(1.0, inside, 0.0) == 1.0
    assert band_step(1.0, 0.0, 0.0, allow_growth=False) == 1.0
    # outside by less than one std of the count noise: no move
    assert band_step(1.0, low - 0.05, 0.1) == 1.0
    assert band_step(1.0, high + 0.03, 0.1) == 1.0


def test_too_small_clip_grows_to_the_band_and_too_large_shrinks_to_it():
    rng = np.random.default_rng(0)
    norms = np.exp(rng.normal(0.0, 0.3, size=int(M)))  # median about 1, m of them
    small, large = _rule(c_init=0.01, z=0.0), _rule(c_init=100.0, z=0.0)
    for _ in range(30):
        for rule in (small, large):
            rule.observe(_obs(norms, 0.5), rng)
    for rule in (small, large):
        frac = float(np.mean(norms <= rule.clip_norm))
        assert BAND[0] - 0.05 <= frac <= BAND[1] + 0.05, (rule.clip_norm, frac)


# -- the brake ----------------------------------------------------------------------------


def test_a_wobbling_loss_never_shrinks_c_where_dp_lac_ratchets_down():
    """A flat loss with +-2% alternating wobble: DP-LAC loses C on every rise, lac-2s none."""
    rng = np.random.default_rng(1)
    rule = _rule(z=0.0)
    lac = make_clip_rule("lac", ClipConfig(noise_multiplier=0.0))
    for t in range(100):
        loss = 0.6 * (1 + 0.02 * (-1) ** t)
        assert rule.observe(_obs(INSIDE, loss), rng) == 1.0
        lac.observe(_obs(INSIDE, loss), rng)
    assert lac.clip_norm < 0.2


def test_a_real_rise_brakes_once_per_cooldown_and_holds_growth():
    rng = np.random.default_rng(2)
    rule = _rule(z=0.0)
    clipped = [5.0] * 20  # every update clipped: the band would grow C
    for loss in (0.7, 0.6, 0.5):
        rule.observe(_obs(INSIDE, loss), rng)
    assert rule.clip_norm == 1.0
    c = [rule.observe(_obs(clipped, loss), rng) for loss in (2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0)]
    assert c[0] == pytest.approx(0.5)  # the smoothed loss rose > RISE: C halves
    assert c[1] == c[2] == pytest.approx(0.5)  # cooldown; growth held (loss above best)
    assert c[3] == pytest.approx(0.25)  # still rising after the cooldown: halves again
    assert min(c) > 0


def test_a_rise_within_the_tolerance_does_not_brake():
    rng = np.random.default_rng(3)
    rule = _rule(z=0.0)
    for loss in [0.5] * 5 + [0.5 * (1 + 0.9 * RISE)] * 10:
        rule.observe(_obs(INSIDE, loss), rng)
    assert rule.clip_norm == 1.0


def test_state_round_trip_continues_identically():
    rng_a, rng_b = np.random.default_rng(4), np.random.default_rng(4)
    a = _rule(z=1.0)
    for loss in (0.7, 0.6, 1.2):
        a.observe(_obs([0.5, 2.0, 3.0], loss), rng_a)
        rng_b.normal()  # the same draws consumed
    b = _rule(z=1.0)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    obs = _obs([0.5, 2.0, 3.0], 1.5)
    assert a.observe(obs, rng_a) == b.observe(obs, rng_b)


# -- privacy ------------------------------------------------------------------------------


def _cfg(**kw) -> ServerConfig:
    base = dict(
        method="lac-2s",
        num_clients=N,
        clients_per_round=M,
        rounds=T,
        target_epsilon=EPS,
        delta=DELTA,
        insecure_seed=0,
        vote_budget_share=VOTE_SHARE,
        count_budget_share=COUNT_SHARE,
    )
    return ServerConfig(**dict(base, **kw))


def _rdp_epsilon(event: dpa.DpEvent) -> float:
    acc = rdp.RdpAccountant()
    acc.compose(event)
    return acc.get_epsilon(DELTA)


def _independent_vote_sigma() -> float:
    """The Gaussian (sensitivity 1) that alone spends VOTE_SHARE of EPS: bisection here."""
    lo, hi = 0.1, 1e3
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        lo, hi = (
            (mid, hi) if _rdp_epsilon(dpa.GaussianDpEvent(mid)) > VOTE_SHARE * EPS else (lo, mid)
        )
    return hi


def _run(rounds: int = T) -> DPFedAvgServer:
    rng = np.random.default_rng(5)
    server = DPFedAvgServer(_cfg(), [np.zeros(4, np.float32)], lambda p: (0.5, 0.5))
    cands = server.rule.candidates()
    server.initialise(
        [[1 if j == i % len(cands) else 0 for j in range(len(cands))] for i in range(N)]
    )
    for _ in range(rounds):
        sampled = server.sample_clients(list(range(N)))
        replies = [ClientReply(n, update=[rng.normal(size=4).astype(np.float32)]) for n in sampled]
        server.aggregate(sampled, replies)
    return server


def test_epsilon_matches_an_independent_dp_accounting_composition():
    server = _run()
    z = server.noise_multiplier
    sigma_h = _independent_vote_sigma()
    z_update = z / math.sqrt(1 - COUNT_SHARE)
    z_count = z / math.sqrt(COUNT_SHARE)  # 2 sigma_b: the centred count has sensitivity 1/2
    rounds = dpa.PoissonSampledDpEvent(
        M / N, dpa.ComposedDpEvent([dpa.GaussianDpEvent(z_update), dpa.GaussianDpEvent(z_count)])
    )
    direct = dpa.ComposedDpEvent([dpa.GaussianDpEvent(sigma_h), dpa.SelfComposedDpEvent(rounds, T)])
    eps = server.accountant.epsilon()
    assert eps == pytest.approx(_rdp_epsilon(direct), rel=1e-3)
    assert eps == pytest.approx(EPS, rel=1e-3)
    assert server.accountant.one_offs == [pytest.approx(sigma_h, rel=1e-3)]
    assert len(server.accountant.rounds) == T


def test_vote_noise_drawn_is_the_noise_accounted():
    server = DPFedAvgServer(_cfg(), [np.zeros(4, np.float32)])
    sigma_h = _independent_vote_sigma()
    k = len(server.rule.candidates())
    votes = [[1 if j == 0 else 0 for j in range(k)]] * 50
    draws = np.array(
        [server.rule.initialise_from_votes(votes, np.random.default_rng(s)) for s in range(400)]
    )
    draws[:, 0] -= 50
    assert draws.std() == pytest.approx(sigma_h, rel=0.05)


class _RecordingRng:
    """Stands in for the noise generator: records the std of each Gaussian draw."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def normal(self, loc: float = 0.0, scale: float = 1.0, size=None):
        self.scales.append(float(scale))
        return 0.0 if size is None else np.zeros(size)


def test_count_and_update_noise_drawn_are_the_noise_accounted():
    server = DPFedAvgServer(_cfg(), [np.zeros(4, np.float32)])
    rule, z = server.rule, server.noise_multiplier
    z_update, z_count = server.round_multipliers
    assert z_update == pytest.approx(z / math.sqrt(1 - COUNT_SHARE), rel=1e-9)
    assert z_count == pytest.approx(z / math.sqrt(COUNT_SHARE), rel=1e-9)
    assert rule.update_noise_std() == pytest.approx(z_update * rule.clip_norm)
    rng = _RecordingRng()
    rule.observe(_obs([0.5] * 20, 0.5), rng)
    # one draw on the centred count (sensitivity 1/2): std z_count / 2
    assert rng.scales == [pytest.approx(z_count / 2, rel=1e-9)]
    assert rule.fraction_std() == pytest.approx(z_count / 2 / M, rel=1e-9)


# -- the CLI ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["lac-2s", "fixed", "adaptive-quantile", "automatic"])
def test_c_init_sets_every_rule_s_initial_clip(method):
    import argparse

    from dpfit.federated.cli import add_arguments, configs

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    server_cfg, _ = configs(parser.parse_args(["--method", method, "--c-init", "0.1"]))
    assert server_cfg.initial_clip == 0.1
    alias, _ = configs(parser.parse_args(["--method", method, "--initial-clip", "0.1"]))
    assert alias == server_cfg

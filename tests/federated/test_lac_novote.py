"""DP-LAC without the vote (``lac-c0``): the whole budget goes to the rounds (its epsilon is
dp-accounting's for the rounds alone, at the target), nothing is spent before round 1, and C
moves as DP-LAC's from the given C0, first after round 1 (v_0 recorded at the start)."""

from __future__ import annotations

import numpy as np
import pytest
from accounting_oracle import ADD_REMOVE, direct_epsilon

from dpfit.federated.clipping.lac_novote import NAME, start_without_vote
from dpfit.federated.strategy import ClientReply, DPFedAvgServer, ServerConfig

Q_N, Q_M, ROUNDS, EPS, DELTA = 1000, 100, 30, 8.0, 1e-5


def _cfg(method: str, initial_clip: float = 1.0) -> ServerConfig:
    return ServerConfig(
        method=method, num_clients=Q_N, clients_per_round=Q_M, rounds=ROUNDS,
        target_epsilon=EPS, delta=DELTA, initial_clip=initial_clip, insecure_seed=3,
    )  # fmt: skip


def _losses(values):
    it = iter(values)
    return lambda params: (next(it), 0.5)


def test_all_of_epsilon_goes_to_the_rounds():
    server = DPFedAvgServer(_cfg(NAME), [np.zeros(4, np.float32)])
    z = server.noise_multiplier
    rounds_only = direct_epsilon(z, Q_M / Q_N, ROUNDS, DELTA, ADD_REMOVE, kind="rdp")
    assert rounds_only == pytest.approx(EPS, rel=1e-3)  # no vote share held back
    voted = DPFedAvgServer(_cfg("lac"), [np.zeros(4, np.float32)])
    assert z < voted.noise_multiplier  # DP-LAC's rounds get less: the vote took its share


def test_nothing_is_spent_before_round_1_and_the_ledger_is_the_rounds():
    v = [1.0, 0.8, 0.9, 0.6]  # v_0 .. v_3
    server = DPFedAvgServer(_cfg(NAME, initial_clip=0.5), [np.zeros(4, np.float32)], _losses(v))
    start_without_vote(server)
    assert server.accountant.one_offs == [] and server.rule.clip_norm == 0.5
    rng = np.random.default_rng(0)
    clips = []
    for _ in range(3):
        sampled = server.sample_clients(list(range(Q_N)))
        replies = [ClientReply(n, update=[rng.normal(size=4).astype(np.float32)])
                   for n in sampled]  # fmt: skip
        clips.append(server.aggregate(sampled, replies).clip_norm)
    # DP-LAC's shrink from C0: after round t, C = C_{t-1} * min(1, v_t / v_{t-1})
    assert clips == pytest.approx([0.5, 0.5 * 0.8, 0.5 * 0.8])
    assert server.rule.clip_norm == pytest.approx(0.5 * 0.8 * 0.6 / 0.9)
    z = server.noise_multiplier
    want = direct_epsilon(z, Q_M / Q_N, 3, DELTA, ADD_REMOVE, kind="rdp")
    assert server.accountant.epsilon() == pytest.approx(want, rel=1e-6)


def test_start_without_vote_refuses_a_voting_rule():
    server = DPFedAvgServer(_cfg("lac"), [np.zeros(4, np.float32)])
    with pytest.raises(TypeError, match=NAME):
        start_without_vote(server)

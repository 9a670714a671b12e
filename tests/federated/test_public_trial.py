"""``public-trial``: the server's trial of clip norms on its public data. Its split, its
trial loss (the noise's std checked statistically), the rule's choice, its privacy ledger
(fixed's, against dp-accounting computed directly) and both engines end to end."""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from dp_accounting import rdp

from dpfit.federated.clipping import ClipConfig, ClipRuleError, PublicTrialClip, make_clip_rule
from dpfit.federated.clipping.public_trial import FACTORS
from dpfit.federated.public_trial import (
    PER_CLIENT,
    make_trial_fn,
    pseudo_rngs,
    split_public,
    trial_losses,
)
from dpfit.federated.strategy import ClientReply, DPFedAvgServer, ServerConfig


def _rule(c_init=1.0, z=1.2, m=20.0, rounds=16) -> PublicTrialClip:
    cfg = ClipConfig(initial_clip=c_init, noise_multiplier=z, expected_clients=m,
                     total_rounds=rounds)  # fmt: skip
    return make_clip_rule("public-trial", cfg)


# -- the split --------------------------------------------------------------------------------


def test_the_public_set_splits_into_pseudo_clients_and_a_disjoint_scoring_half():
    texts = [f"t{i}" for i in range(101)]
    labels = [i % 2 for i in range(101)]
    pseudo, score_texts, score_labels = split_public(texts, labels, seed=3)
    fit = [e.text for d in pseudo for e in d]
    assert all(len(d) == PER_CLIENT for d in pseudo) and len(pseudo) == 50 // PER_CLIENT
    assert not set(fit) & set(score_texts) and len(score_texts) == 51
    assert all(labels[int(t[1:])] == y for t, y in zip(score_texts, score_labels, strict=True))
    assert all(e.label == labels[int(e.text[1:])] for d in pseudo for e in d)
    again = split_public(texts, labels, seed=3)
    assert [[e.text for e in d] for d in again[0]] == [[e.text for e in d] for d in pseudo]
    assert split_public(texts, labels, seed=4)[1] != score_texts
    with pytest.raises(ClipRuleError, match="at least 40 validation examples"):
        split_public(texts[:39], labels[:39], seed=0)


# -- the trial loss ---------------------------------------------------------------------------


def _quadratic(target):
    """A score whose loss is the squared distance to ``target`` (accuracy unused)."""

    def score(params):
        return float(sum(np.sum((p - t) ** 2) for p, t in zip(params, target, strict=True))), 0.0

    return score


def test_without_noise_the_trial_is_the_mean_of_the_clipped_updates():
    start = [np.zeros(3), np.zeros(2)]
    updates = [[np.array([3.0, 0, 0]), np.array([4.0, 0])], [np.array([0, 1.0, 0]), np.zeros(2)]]
    target = [np.array([1.0, 0.5, 0]), np.array([1.0, 0])]
    got = trial_losses(updates, start, [1.0, 10.0], 0.0, _quadratic(target),
                       np.random.default_rng(0), draws=1)  # fmt: skip
    for c, loss in zip([1.0, 10.0], got, strict=True):
        scale = [min(1.0, c / 5.0), 1.0]  # the first update has norm 5, the second 1
        mean = [sum(s * u[i] for s, u in zip(scale, updates, strict=True)) / 2 for i in (0, 1)]
        assert loss == pytest.approx(_quadratic(target)(mean)[0])


def test_the_trial_noise_has_std_k_times_c_per_coordinate():
    """E||x + N(0, s^2 I_d) - t||^2 = ||x - t||^2 + d s^2: the mean trial loss over many
    draws identifies s = k C (a 10% larger noise is 21% more variance, far outside)."""
    d, k, c, draws = 400, 0.05, 2.0, 400
    start, updates = [np.zeros(d)], [[np.zeros(d)]]
    loss = trial_losses(updates, start, [c], k, _quadratic([np.zeros(d)]),
                        np.random.default_rng(5), draws=draws)[0]  # fmt: skip
    expected = d * (k * c) ** 2
    # the loss of one draw is s^2 chi2_d: std s^2 sqrt(2 d); the mean of `draws`, / sqrt(draws)
    tol = 4 * (k * c) ** 2 * math.sqrt(2 * d / draws)
    assert abs(loss - expected) < tol
    assert abs(loss - 1.21 * expected) > tol


def test_every_candidate_sees_the_same_noise_draws():
    """A candidate's trial loss does not depend on which others are scored beside it."""
    rng = np.random.default_rng(9)
    start = [rng.standard_normal(5), rng.standard_normal(3)]
    updates = [[rng.standard_normal(5), rng.standard_normal(3)] for _ in range(4)]
    score = _quadratic([np.ones(5), np.zeros(3)])
    alone = trial_losses(updates, start, [0.5], 0.3, score, np.random.default_rng(1))
    beside = trial_losses(updates, start, [5.0, 0.05, 0.5], 0.3, score, np.random.default_rng(1))
    assert beside[2] == pytest.approx(alone[0], rel=1e-12)


# -- the rule ----------------------------------------------------------------------------------


def test_candidates_span_a_hundredfold_either_side_and_the_lowest_loss_wins():
    rule = _rule(c_init=2.0)
    assert rule.candidates() == pytest.approx([2.0 * f for f in FACTORS])
    assert min(rule.candidates()) == pytest.approx(0.02) and max(rule.candidates()) == 200.0
    assert rule.trial_noise_per_clip() == pytest.approx(1.2 * 4.0 / 20.0)  # z sqrt(T) / m
    losses = [5.0] * len(FACTORS)
    losses[3], losses[8] = 1.0, 1.0  # a tie: the smaller clip
    losses[0] = math.nan  # never chosen
    assert rule.initialise_from_trial(losses) == pytest.approx(2.0 * FACTORS[3])
    assert rule.observe(None, np.random.default_rng(0)) == rule.clip_norm  # then fixed
    with pytest.raises(ClipRuleError, match="non-finite"):
        _rule().initialise_from_trial([math.inf] * len(FACTORS))
    with pytest.raises(ClipRuleError, match="trial losses"):
        _rule().initialise_from_trial([1.0, 2.0])


# -- the server: the trial's randomness and the ledger ----------------------------------------

N, M, T, EPS, DELTA = 200, 20.0, 12, 4.0, 1e-5


def _cfg(method="public-trial", **kw) -> ServerConfig:
    base = dict(method=method, num_clients=N, clients_per_round=M, rounds=T,
                target_epsilon=EPS, delta=DELTA, initial_clip=1.0)  # fmt: skip
    return ServerConfig(**dict(base, **kw))


def test_the_server_chooses_c_from_the_trial_with_its_own_noise_generator():
    seen = {}

    def trial(start, candidates, noise_per_clip, rng):
        seen.update(candidates=list(candidates), k=noise_per_clip, rng=rng)
        return [abs(math.log(c / 0.2)) for c in candidates]  # lowest at 0.2

    cfg = _cfg(target_epsilon=None, noise_multiplier=1.3)
    server = DPFedAvgServer(cfg, [np.zeros(3, np.float32)], trial_fn=trial)
    server.initialise()
    assert server.rule.clip_norm == pytest.approx(0.2) == server.initial_clip
    assert seen["rng"] is server.noise_rng  # OS entropy unless an insecure seed was asked for
    assert seen["k"] == pytest.approx(server.rule.update_multiplier * math.sqrt(T) / M)
    with pytest.raises(ClipRuleError, match="public-trial needs the server's trial"):
        DPFedAvgServer(cfg, [np.zeros(3, np.float32)]).initialise()


def test_the_trial_costs_no_privacy_the_ledger_is_fixed_s():
    """Same calibrated z as fixed, no one-off release, and the epsilon of T rounds equals
    dp-accounting's Poisson-subsampled Gaussian composed T times, computed here."""
    trial = lambda start, cands, k, rng: [float(c) for c in cands]  # noqa: E731
    server = DPFedAvgServer(_cfg(), [np.zeros(3, np.float32)], trial_fn=trial)
    fixed = DPFedAvgServer(_cfg("fixed"), [np.zeros(3, np.float32)])
    assert server.noise_multiplier == pytest.approx(fixed.noise_multiplier, rel=1e-9)
    assert server.round_multipliers == (server.noise_multiplier,)
    server.initialise()
    for _ in range(T):
        sampled = server.sample_clients(list(range(N)))
        server.aggregate(
            sampled, [ClientReply(n, update=[np.ones(3, np.float32)]) for n in sampled]
        )
    acc = rdp.RdpAccountant()
    event = dpa.PoissonSampledDpEvent(M / N, dpa.GaussianDpEvent(server.noise_multiplier))
    acc.compose(dpa.SelfComposedDpEvent(event, T))
    assert server.accountant.epsilon() == pytest.approx(acc.get_epsilon(DELTA), rel=1e-6)
    assert server.accountant.epsilon() <= EPS * (1 + 1e-9)


def test_the_round_noise_std_is_z_times_the_chosen_c():
    trial = lambda start, cands, k, rng: [abs(c - 0.5) for c in cands]  # noqa: E731
    server = DPFedAvgServer(_cfg(), [np.zeros(3, np.float32)], trial_fn=trial)
    server.initialise()
    assert server.rule.update_noise_std() == pytest.approx(server.noise_multiplier * 0.5)


# -- both engines, end to end ------------------------------------------------------------------


def test_a_whole_run_batched_equals_the_in_process_flower_run(tmp_path_factory):
    from dpfit.federated.app import run_local
    from dpfit.federated.batched import run_batched
    from dpfit.federated.client import TaskConfig
    from dpfit.models import save_tiny_random_model

    bert = str(save_tiny_random_model(tmp_path_factory.mktemp("bert"), arch="bert"))
    task = TaskConfig(
        model=bert, local_mode="lora-top", lora_r=4, max_length=16, local_epochs=1,
        local_batch_size=4, lr=0.05, num_clients=8, examples_per_client=5, eval_examples=60,
    )  # fmt: skip
    cfg = ServerConfig(
        method="public-trial", num_clients=8, clients_per_round=4, rounds=2,
        target_epsilon=None, noise_multiplier=0.5, initial_clip=0.5, insecure_seed=3,
    )  # fmt: skip
    flower = run_local(cfg, task)
    batched = run_batched(cfg, task)
    assert batched.initial_clip == pytest.approx(flower.initial_clip)
    assert any(batched.initial_clip == pytest.approx(0.5 * f) for f in FACTORS)
    assert [r.clip_norm for r in batched.history] == [batched.initial_clip] * 2
    for a, b in zip(batched.params, flower.params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=3e-4)


def test_make_trial_fn_trains_the_pseudo_clients_from_the_given_start():
    texts = [f"t{i}" for i in range(40)]
    labels = [i % 2 for i in range(40)]
    calls = []

    def train(start, data):
        calls.append((start, [[e.text for e in d] for d in data]))
        return [[np.full(2, float(len(d)))] for d in data]

    trial = make_trial_fn(train, lambda t, y: (lambda p: (float(p[0].sum()), 0.0)),
                          texts, labels, seed=1)  # fmt: skip
    start = [np.zeros(2)]
    got = trial(start, [1.0, 100.0], 0.0, np.random.default_rng(0))
    assert len(calls) == 1 and calls[0][0] is start and len(calls[0][1]) == 2
    # each update is (10, 10), norm 14.1: clipped to 1 -> sum 1.414; unclipped -> 20
    assert got == pytest.approx([math.sqrt(2), 20.0])
    assert len(pseudo_rngs(0, 3)) == 3

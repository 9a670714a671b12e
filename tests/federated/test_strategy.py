"""Server core and Flower Strategy: sampling, aggregation, faults, budget stop, resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from dpfit.checkpoint import CheckpointForkError
from dpfit.federated.app import LocalGrid
from dpfit.federated.clipping import clip_rule_names
from dpfit.federated.strategy import (
    CheckpointMismatch,
    ClientReply,
    DPFedAvg,
    DPFedAvgServer,
    InvalidUpdate,
    ServerConfig,
    validate_update,
)

SHAPES = [(3, 2), (4,)]


def _init():
    return [np.zeros(s, dtype=np.float32) for s in SHAPES]


def _cfg(**kw):
    base = dict(method="fixed", num_clients=10, clients_per_round=4, rounds=3, noise_multiplier=0.0)
    base.update(kw)
    return ServerConfig(**base)


def _update(value: float):
    return [np.full(s, value, dtype=np.float32) for s in SHAPES]


def test_poisson_sampling_rate_matches_q():
    server = DPFedAvgServer(_cfg(num_clients=50, clients_per_round=10), _init())
    sizes = [len(server.sample_clients(list(range(50)))) for _ in range(400)]
    assert np.mean(sizes) == pytest.approx(10, rel=0.05)
    assert np.var(sizes) == pytest.approx(50 * 0.2 * 0.8, rel=0.3)  # binomial, not fixed m


def test_equal_weight_average_divides_by_expected_clients():
    server = DPFedAvgServer(_cfg(initial_clip=100.0), _init())
    replies = [
        ClientReply(1, _update(1.0), {"num_examples": 1000}),
        ClientReply(2, _update(3.0), {"num_examples": 1}),
    ]
    server.aggregate([1, 2, 3], replies)
    np.testing.assert_allclose(server.params[1], (1.0 + 3.0) / 4)  # /m, not /answered
    assert (server.last_counts.sampled, server.last_counts.answered) == (3, 2)


def test_clipping_uses_rule_norm_and_noise_std_is_z_times_c():
    server = DPFedAvgServer(_cfg(initial_clip=0.5, noise_multiplier=2.0), _init())
    big = _update(10.0)
    rec = server.aggregate([1], [ClientReply(1, big, {})])
    assert rec.noise_std == pytest.approx(2.0 * 0.5)
    # noiseless check of the clipped contribution
    quiet = DPFedAvgServer(_cfg(initial_clip=0.5), _init())
    quiet.aggregate([1], [ClientReply(1, big, {})])
    norm = math.sqrt(sum(float(np.sum(p**2)) for p in quiet.params))
    assert norm == pytest.approx(0.5 / 4, rel=1e-5)


def test_noise_on_aggregate_has_the_calibrated_scale():
    server = DPFedAvgServer(
        _cfg(initial_clip=1.0, noise_multiplier=3.0, clients_per_round=2), [np.zeros(20000)]
    )
    server.shapes = [(20000,)]
    server.aggregate([], [])
    assert np.std(server.params[0]) == pytest.approx(3.0 * 1.0 / 2, rel=0.03)


@pytest.mark.parametrize(
    "bad,match",
    [
        ([np.full((3, 2), np.nan), np.zeros(4)], "NaN or Inf"),
        ([np.zeros((3, 2)), np.full(4, np.inf)], "NaN or Inf"),
        ([np.zeros((2, 3)), np.zeros(4)], "shape"),
        ([np.zeros((3, 2))], "expected 2 arrays"),
    ],
)
def test_bad_updates_are_rejected_and_logged(bad, match, caplog):
    with pytest.raises(InvalidUpdate, match=match):
        validate_update(bad, SHAPES)
    server = DPFedAvgServer(_cfg(initial_clip=100.0), _init())
    server.aggregate([1, 2], [ClientReply(1, bad, {}), ClientReply(2, _update(2.0), {})])
    assert server.last_counts.rejected == 1
    assert np.all(np.isfinite(server.params[0]))
    np.testing.assert_allclose(server.params[1], 2.0 / 4)
    assert "rejected" in caplog.text


def test_missing_and_crashed_clients_do_not_stall_and_accounting_uses_sampling():
    server = DPFedAvgServer(_cfg(noise_multiplier=1.0), _init())
    rec = server.aggregate([1, 2, 3], [ClientReply(2, error="boom")])
    counts = server.last_counts
    assert (counts.sampled, counts.answered, counts.rejected) == (3, 1, 1)
    assert len(server.accountant.rounds) == 1  # the round is paid for anyway
    assert math.isfinite(rec.epsilon)


def test_checkpoint_resume_continues_identically(tmp_path):
    quantile = dict(method="adaptive-quantile", noise_multiplier=1.0, insecure_seed=3)
    cfg = _cfg(**quantile, checkpoint_dir=str(tmp_path))
    replies = lambda r: [ClientReply(i, _update(0.1 * (i + r)), {}) for i in range(1, 4)]  # noqa: E731
    full = DPFedAvgServer(_cfg(**quantile), _init())
    for r in range(3):
        full.aggregate([1, 2, 3], replies(r))
    part = DPFedAvgServer(cfg, _init())
    for r in range(2):
        part.aggregate([1, 2, 3], replies(r))
    resumed = DPFedAvgServer(cfg, _init())  # a restarted server
    assert resumed.load_checkpoint(tmp_path)
    assert resumed.round == 2 and len(resumed.history) == 2
    resumed.aggregate([1, 2, 3], replies(2))
    for a, b in zip(full.params, resumed.params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert resumed.rule.clip_norm == pytest.approx(full.rule.clip_norm)
    assert resumed.accountant.epsilon() == pytest.approx(full.accountant.epsilon())
    other = DPFedAvgServer(_cfg(method="fixed", noise_multiplier=1.0), _init())
    with pytest.raises(CheckpointMismatch, match="checkpoint-dir"):
        other.load_checkpoint(tmp_path)
    # an insecurely seeded run cannot be resumed as if it were private
    secure = DPFedAvgServer(_cfg(method="adaptive-quantile", noise_multiplier=1.0), _init())
    with pytest.raises(CheckpointMismatch, match="insecure_seed"):
        secure.load_checkpoint(tmp_path)


def test_secure_continuations_draw_fresh_noise_and_a_fork_must_be_asked(tmp_path):
    """Federated: a secure checkpoint holds no generator state.

    Two continuations of one checkpoint must not share noise: their released models would
    then differ by the noise-free difference of their updates. A second continuation is
    refused unless asked for; the crash-resume chain (resume the continuation's own newer
    checkpoint) is not.
    """
    d = 2000
    init = [np.zeros(d, dtype=np.float32)]
    cfg = _cfg(method="fixed", noise_multiplier=1.0, initial_clip=1.0, checkpoint_dir=str(tmp_path))
    first = DPFedAvgServer(cfg, init)
    first.aggregate([1, 2], [ClientReply(i, [np.full(d, 0.01, np.float32)], {}) for i in (1, 2)])
    assert (tmp_path / "state.json").exists()
    assert json.loads((tmp_path / "state.json").read_text())["rng"] is None

    replies = [ClientReply(i, [np.full(d, 0.02, np.float32)], {}) for i in (1, 2)]
    a = DPFedAvgServer(cfg, init)
    assert a.load_checkpoint(tmp_path) and a.continuation.number == 1
    a_params = [p.copy() for p in a.params]
    refused = DPFedAvgServer(_cfg(**{**cfg.__dict__, "checkpoint_dir": None}), init)
    with pytest.raises(CheckpointForkError, match="--fork"):
        refused.load_checkpoint(tmp_path)
    b = DPFedAvgServer(_cfg(**{**cfg.__dict__, "checkpoint_dir": None, "allow_fork": True}), init)
    assert b.load_checkpoint(tmp_path) and b.continuation.fork
    for p, q in zip(a_params, b.params, strict=True):
        np.testing.assert_array_equal(p, q)  # the same starting point
    a.aggregate([1, 2], replies)  # writes round 2: the continuation's own checkpoint
    b.aggregate([1, 2], replies)
    diff = a.params[0] - b.params[0]
    # each continuation adds N(0, (z C)^2) / m with z = C = 1, m = 4: the difference has std
    # sqrt(2) / 4; shared generators would make it exactly 0
    assert np.std(diff) == pytest.approx(math.sqrt(2) / 4, rel=0.1)
    # crash after the first continuation's round: resuming its newer checkpoint is no fork
    again = DPFedAvgServer(cfg, init)
    assert again.load_checkpoint(tmp_path) and again.round == 2
    assert not again.continuation.fork


def test_insecure_resume_restores_the_generators(tmp_path):
    cfg = _cfg(
        method="adaptive-quantile",
        noise_multiplier=1.0,
        insecure_seed=7,
        checkpoint_dir=str(tmp_path),
    )
    part = DPFedAvgServer(cfg, _init())
    part.aggregate([1, 2], [ClientReply(1, _update(0.1), {}), ClientReply(2, _update(0.2), {})])
    resumed = DPFedAvgServer(cfg, _init())
    assert resumed.load_checkpoint(tmp_path)
    assert resumed.noise_rng.bit_generator.state == part.noise_rng.bit_generator.state
    assert resumed.sampling_rng.bit_generator.state == part.sampling_rng.bit_generator.state


# ------------------------------------------------------------------ privacy-critical randomness


def _run_rule(method: str, insecure_seed: int | None, rounds: int = 3) -> dict:
    """A short run on fixed replies; returns everything the server's randomness could touch."""
    cfg = _cfg(
        method=method,
        num_clients=50,
        clients_per_round=25,
        noise_multiplier=1.0,
        initial_clip=0.5,
        vote_noise_std=3.0,
        insecure_seed=insecure_seed,
    )
    val = iter([1.0 / (k + 1) for k in range(rounds + 2)])
    # public-trial's trial on public data (its noise from the server's generator)
    trial = lambda start, cands, k, rng: [abs(c - 0.5) + 0.01 * rng.random() for c in cands]  # noqa: E731
    server = DPFedAvgServer(cfg, _init(), evaluate_fn=lambda p: (next(val), 0.5), trial_fn=trial)
    votes = [[0, 1, 0]] * 30 + [[1, 0, 0]] * 20 if server.rule.needs_votes else None
    server.initialise(votes)
    sampled_all, clips = [], []
    for _ in range(rounds):
        sampled_all.append(server.sample_clients(list(range(50))))
        # the same cohort every round, so that only the server's noise separates two runs
        cohort = list(range(25))
        replies = [ClientReply(i, _update(0.05 * (i % 7)), {"loss_before": 0.5}) for i in cohort]
        server.aggregate(cohort, replies)
        clips.append(server.rule.clip_norm)
    return {
        "sampled": sampled_all,
        "params": np.concatenate([p.ravel() for p in server.params]),
        "clips": clips,
        "votes": list(server.vote_counts),
        "rule": server.rule.state_dict(),
    }


# the auxiliary noise each rule draws besides the update noise, as seen in its outputs
AUX_RELEASE = {"adaptive-quantile": "clips", "lac": "votes", "clac": "rule"}


@pytest.mark.parametrize("method", clip_rule_names())
def test_public_seed_does_not_determine_sampling_or_any_noise(method):
    """Two runs with the same public settings differ in sampling, update noise and the rule's
    own noise (count, vote, loss); with the same insecure_seed they are identical."""
    a, b = _run_rule(method, None), _run_rule(method, None)
    assert a["sampled"] != b["sampled"]
    assert not np.allclose(a["params"], b["params"])
    if method in AUX_RELEASE:
        assert a[AUX_RELEASE[method]] != b[AUX_RELEASE[method]]
    c, d = _run_rule(method, 11), _run_rule(method, 11)
    assert c["sampled"] == d["sampled"]
    np.testing.assert_array_equal(c["params"], d["params"])
    assert (c["clips"], c["votes"], c["rule"]) == (d["clips"], d["votes"], d["rule"])


def test_insecure_seed_warns(caplog):
    DPFedAvgServer(_cfg(insecure_seed=4), _init())
    assert "NOT private" in caplog.text


# ------------------------------------------------------------------ through Flower messages


def _fake_client(value: float | None = None, crash: bool = False, silent: bool = False):
    def fn(msg, ctx):
        if crash:
            raise RuntimeError("client crashed")
        if silent:
            return None
        if msg.metadata.message_type.startswith("query"):
            content = RecordDict({"vote": MetricRecord({"vote": [0, 1, 0]})})
            return Message(content=content, reply_to=msg)
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        upd = [np.full(a.shape, value, dtype=np.float32) for a in arrays]
        content = RecordDict(
            {"update": ArrayRecord(upd), "metrics": MetricRecord({"loss_before": 0.5})}
        )
        return Message(content=content, reply_to=msg)

    return fn


def _grid(num: int, faulty: dict[int, dict]):
    clients = {n: _fake_client(**faulty.get(n, {"value": 0.01})) for n in range(num)}
    return LocalGrid(clients, {n: {"partition-id": n} for n in range(num)})


def test_strategy_runs_rounds_with_faulty_clients_through_messages(caplog):
    faulty = {0: {"crash": True}, 1: {"silent": True}, 2: {"value": float("nan")}}
    cfg = _cfg(num_clients=6, clients_per_round=6, rounds=3, initial_clip=10.0)
    counts = []
    strategy = DPFedAvg(
        DPFedAvgServer(cfg, _init()), {}, on_round=lambda r: counts.append(server.last_counts)
    )
    server = strategy.server
    strategy.start(_grid(6, faulty))
    assert server.round == 3
    for c in counts:
        assert (c.sampled, c.answered, c.rejected) == (6, 5, 2)
    np.testing.assert_allclose(server.params[1], 3 * 3 * 0.01 / 6, rtol=1e-5)
    assert "NaN" in caplog.text


def test_lac_vote_round_and_budget_stop_through_messages():
    cfg = _cfg(
        method="lac",
        num_clients=6,
        clients_per_round=3,
        rounds=4,
        noise_multiplier=None,
        target_epsilon=8.0,
        initial_clip=2.0,
        vote_noise_std=2.0,
        insecure_seed=0,  # the vote's noise could otherwise flip the winner now and then
    )
    server = DPFedAvgServer(cfg, _init(), evaluate_fn=lambda p: (1.0, 0.5))
    strategy = DPFedAvg(server, {})
    strategy.start(_grid(6, {}), num_rounds=6)  # asks for more rounds than the budget allows
    assert server.initial_clip == pytest.approx(1.0)  # 0.5 x C_init won the vote
    assert server.round == 4
    assert "would bring client-level epsilon" in server.stop_reason
    assert server.accountant.epsilon() <= 8.0 * (1 + 1e-6)


def test_dirichlet_with_too_many_clients_is_a_clear_error():
    from dpfit.federated.app import PartitionError, partitions

    with pytest.raises(PartitionError, match="--alpha"):
        partitions(1000, "dirichlet", 0.5, 0)


def test_released_files_carry_no_client_counts(tmp_path):
    """Same noise, same accepted updates, different numbers of sampled, failed and invalid
    clients: every released file must be byte-identical (exact counts are operator-only)."""
    from dpfit.federated.cli import summary, write_files
    from dpfit.federated.client import TaskConfig

    outputs = []
    for extra in ([], [ClientReply(3, error="boom"), ClientReply(4, _update(math.nan), {})]):
        cfg = _cfg(method="adaptive-quantile", noise_multiplier=1.0, insecure_seed=9)
        server = DPFedAvgServer(cfg, _init())
        good = [ClientReply(1, _update(0.1), {}), ClientReply(2, _update(0.3), {})]
        sampled = [1, 2] + [r.node_id for r in extra] + [5] * bool(extra)  # 5: never answers
        for _ in range(2):
            server.aggregate(sampled, good + extra)
        out = tmp_path / f"out{len(extra)}"
        write_files(server.history, summary(server, TaskConfig(), 0.5, 0.7), out, plots=False)
        outputs.append({f.name: f.read_bytes() for f in sorted(out.iterdir())})
        assert server.last_counts.sampled == len(sampled)  # the operator still sees them
    assert set(outputs[0]) == {"metrics.json", "rounds.csv"}
    assert outputs[0] == outputs[1]


# ------------------------------------------------------------------ noise follows the moving C


def _noise_per_round(method: str, rounds: int = 5, **kw):
    """Zero updates from 20 clients on a 20000-dim model: each round's parameter change is
    pure noise / m. Yields (C_t that clipped the round, measured std of the noise on the sum)."""
    dim, m = 20000, 20
    cfg = _cfg(
        method=method,
        num_clients=40,
        clients_per_round=m,
        rounds=rounds,
        noise_multiplier=1.0,
        initial_clip=2.0,
        vote_noise_std=0.01,
        **kw,
    )
    val = iter([0.8**k for k in range(rounds + 2)])  # LAC: C shrinks by 0.8 a round
    server = DPFedAvgServer(cfg, [np.zeros(dim, dtype=np.float32)], lambda p: (next(val), 0.5))
    server.initialise([[0, 0, 1]] * 10 if server.rule.needs_votes else None)
    zero = [
        ClientReply(i, [np.zeros(dim, dtype=np.float32)], {"loss_before": 1.0}) for i in range(m)
    ]
    for _ in range(rounds):
        before = server.params[0].copy()
        rec = server.aggregate(list(range(m)), zero)
        yield rec.clip_norm, float(np.std((server.params[0] - before) * m / cfg.server_lr))


@pytest.mark.parametrize(
    "method,z_update",
    [
        # quantile: Theorem 1 split with the default 10% count share: z / sqrt(1 - 0.1)
        ("adaptive-quantile", lambda t: 1.0 / math.sqrt(0.9)),
        ("lac", lambda t: 1.0),
        # Du et al.: z_t = z_0 rho^(t/T), rho = 0.5, T = 5 rounds
        ("dynamic", lambda t: 0.5 ** (t / 5)),
    ],
)
def test_noise_std_is_z_times_the_current_clip_after_it_moved(method, z_update):
    """Catches noise scaled by the initial C (or any stale C or z) once they have moved."""
    kw = {"quantile_lr": 0.5} if method == "adaptive-quantile" else {}
    rows = list(_noise_per_round(method, **kw))
    assert rows[-1][0] < 0.75 * rows[0][0], rows  # C really moved
    for t, (clip, measured) in enumerate(rows):
        # 20000 draws: the sample std is within 3% of the true one with overwhelming odds
        assert measured == pytest.approx(z_update(t) * clip, rel=0.03), rows


def test_dynamic_rule_through_the_server_schedule_and_ledger():
    """C_t = C_0 rho_c^(t/T) clips round t, and the ledger records z_t = z_0 rho_s^(t/T)."""
    cfg = _cfg(method="dynamic", rounds=4, noise_multiplier=0.0, initial_clip=1.0)
    server = DPFedAvgServer(cfg, _init())
    big = _update(10.0)  # norm >> C: every round clips to C_t exactly
    for t in range(4):
        before = [p.copy() for p in server.params]
        rec = server.aggregate([1], [ClientReply(1, big, {})])
        assert rec.clip_norm == pytest.approx(0.5 ** (t / 4))
        step = math.sqrt(
            sum(float(np.sum((p - b) ** 2)) for p, b in zip(server.params, before, strict=True))
        )
        assert step == pytest.approx(0.5 ** (t / 4) / 4, rel=1e-5)  # C_t / m
    noisy = DPFedAvgServer(_cfg(method="dynamic", rounds=4, noise_multiplier=2.0), _init())
    for _ in range(4):
        noisy.check_budget()
        noisy.aggregate([1], [ClientReply(1, big, {})])
    assert [r[0] for r in noisy.accountant.rounds] == pytest.approx(
        [2.0 * 0.5 ** (t / 4) for t in range(4)]
    )


def test_automatic_rule_through_the_server_normalises_every_update():
    cfg = _cfg(method="automatic", initial_clip=0.5, noise_multiplier=0.0)
    server = DPFedAvgServer(cfg, _init())
    updates = {1: _update(0.01), 2: _update(3.0)}
    server.aggregate([1, 2], [ClientReply(i, u, {}) for i, u in updates.items()])
    expected = [np.zeros(s) for s in SHAPES]
    for u in updates.values():
        norm = math.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in u))
        for e, a in zip(expected, u, strict=True):
            e += a * 0.5 / (norm + 0.01)  # R / (||Delta|| + gamma), Bu et al. AUTO-S
    for got, e in zip(server.params, expected, strict=True):
        np.testing.assert_allclose(got, e / 4, rtol=1e-5)


# ------------------------------------------------------------------ malformed replies


@pytest.mark.parametrize("method", ["lac", "clac"])
def test_malformed_votes_are_dropped_and_counted_and_the_run_goes_on(method, caplog):
    """[1, 1, -1] sums to 1 with a 1 in it, but is not one-hot; wrong length, NaN, text and
    values of 2 are not either. They are dropped (counted for the operator), the vote uses
    the rest, and the first round runs."""
    cfg = _cfg(method=method, num_clients=20, noise_multiplier=1.0, vote_noise_std=1e-6)
    server = DPFedAvgServer(cfg, _init(), evaluate_fn=lambda p: (0.7, 0.5))
    bad = [[1, 1, -1], [0, 1], [0, float("nan"), 1], ["a", 0, 0], [0, 2, -1], None]
    good = [[0, 1, 0]] * 5 + [[1, 0, 0]] * 2
    server.initialise(bad + good)
    assert server.votes_rejected == len(bad)
    assert server.vote_counts == pytest.approx([2, 5, 0], abs=1e-3)
    assert server.rule.clip_norm == pytest.approx(0.5 * cfg.initial_clip)
    assert "vote dropped" in caplog.text
    server.aggregate([1, 2], [ClientReply(1, _update(0.1), {"loss_before": 0.5})])
    assert server.round == 1


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), "abc", [1.0]])
def test_a_malformed_client_loss_drops_the_reply_and_keeps_the_round(loss):
    server = DPFedAvgServer(_cfg(method="clac", noise_multiplier=0.0, initial_clip=100.0), _init())
    server.initialise([[0, 0, 1]])
    replies = [
        ClientReply(1, _update(1.0), {"loss_before": loss}),
        ClientReply(2, _update(2.0), {"loss_before": 0.5}),
    ]
    server.aggregate([1, 2], replies)
    assert server.last_counts.rejected == 1
    np.testing.assert_allclose(server.params[1], 2.0 / 4)  # only client 2's update
    assert server.rule.losses == [pytest.approx(0.5 / 4)]


def test_median_update_norm_is_in_the_operator_counts_only():
    server = DPFedAvgServer(_cfg(initial_clip=100.0), _init())
    replies = [ClientReply(i, _update(v), {}) for i, v in enumerate([1.0, 2.0, 5.0], 1)]
    rec = server.aggregate([1, 2, 3], replies)
    assert server.last_counts.median_update_norm == pytest.approx(2.0 * math.sqrt(10))
    assert "median_update_norm" not in vars(rec)  # RoundRecord is what a round releases


def test_vote_noise_follows_the_budget_share_rule():
    """sigma_h alone spends vote_budget_share of the target (checked with dp-accounting
    directly), and the run with the vote still meets the target."""
    import dp_accounting as dpa

    for eps, share in [(8.0, 0.1), (2.0, 0.2)]:
        cfg = _cfg(
            method="lac", num_clients=1000, clients_per_round=100, rounds=30,
            noise_multiplier=None, target_epsilon=eps, vote_budget_share=share,
        )  # fmt: skip
        server = DPFedAvgServer(cfg, _init())
        sigma = server.rule.config.vote_noise_std
        acc = dpa.rdp.RdpAccountant()
        acc.compose(dpa.GaussianDpEvent(sigma))
        assert acc.get_epsilon(1e-5) == pytest.approx(share * eps, rel=2e-3)
        assert server.rule.one_off_multipliers(server.rule.config) == (sigma,)
    # an explicit sigma_h wins; a rule without a vote has none
    assert DPFedAvgServer(
        _cfg(method="lac", noise_multiplier=1.0, vote_noise_std=3.0), _init()
    ).rule.config.vote_noise_std == pytest.approx(3.0)
    assert _cfg(method="fixed", noise_multiplier=1.0).vote_noise(1.0) == 0.0


# ------------------------------------------------------------------ huge and duplicate replies


def test_a_float64_update_of_1e200_is_rejected_and_the_model_stays_finite(caplog):
    """1e200 is finite, so an isfinite check passes it; squared it overflows float64, the
    norm is inf, the clip factor 0, and 0 x (1e200 cast to float32 = inf) is NaN."""
    huge = [np.full(s, 1e200, dtype=np.float64) for s in SHAPES]
    with pytest.raises(InvalidUpdate, match="float32"):
        validate_update(huge, SHAPES)
    validate_update([np.full(s, 3e38, dtype=np.float64) for s in SHAPES], SHAPES)  # in range
    server = DPFedAvgServer(_cfg(initial_clip=1.0), _init())
    server.aggregate([1, 2], [ClientReply(1, huge, {}), ClientReply(2, _update(0.1), {})])
    assert server.last_counts.rejected == 1
    assert "client 1 rejected" in caplog.text and "float32" in caplog.text
    for p, u in zip(server.params, _update(0.1), strict=True):
        assert np.all(np.isfinite(p))
        np.testing.assert_allclose(p, u / 4, rtol=1e-6)  # client 2 alone, / m


@pytest.mark.parametrize("value", [1e200, 1e39, -3e38, 1e-300])
def test_the_clip_never_makes_nan_and_bounds_any_finite_update(value):
    """The clip itself, whatever reaches it: a finite update of any size comes out finite and
    of norm C (or less, when it is smaller); its norm is computed without overflow."""
    from dpfit.federated.clipping import clip_update, global_norm, make_clip_rule
    from dpfit.federated.clipping.base import ClipConfig

    update = [np.full(s, value, dtype=np.float64) for s in SHAPES]
    assert global_norm(update) == pytest.approx(abs(value) * math.sqrt(10), rel=1e-12)
    clipped, _ = clip_update(update, 0.5)
    auto, _ = make_clip_rule("automatic", ClipConfig(initial_clip=0.5)).clip(update)
    for out, bound in ((clipped, 0.5), (auto, 0.5)):
        assert all(a.dtype == np.float32 and np.all(np.isfinite(a)) for a in out)
        norm = math.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in out))
        assert norm <= bound * (1 + 1e-6)
        if abs(value) * math.sqrt(10) > 0.5:
            assert norm == pytest.approx(bound, rel=1e-5 if out is clipped else 1e-2)


def test_three_copies_of_one_reply_count_once(caplog):
    """Each sampled client moves the sum by at most C: a second or third reply from one node
    (copies or not) is dropped, the first counts; its loss too (DP-CLAC)."""
    server = DPFedAvgServer(_cfg(method="clac", initial_clip=100.0), _init())
    server.initialise([[0, 0, 1]])
    first = ClientReply(1, _update(1.0), {"loss_before": 0.5})
    other = ClientReply(1, _update(5.0), {"loss_before": 0.9})
    replies = [first, first, other, ClientReply(2, _update(2.0), {"loss_before": 0.5})]
    server.aggregate([1, 2], replies)
    np.testing.assert_allclose(server.params[1], (1.0 + 2.0) / 4)  # not (3 x 1 + 5 + 2) / 4
    assert server.rule.losses == [pytest.approx((0.5 + 0.5) / 4)]
    assert server.last_counts.answered == 2
    assert caplog.text.count("one per client counts") == 2


def test_duplicate_votes_count_once():
    """A node's vote counts once, the first: a client that votes three times moves the noised
    histogram by 1, not 3 (sensitivity 1)."""
    from dpfit.federated.strategy import ClientVote

    cfg = _cfg(method="lac", num_clients=20, noise_multiplier=1.0, vote_noise_std=1e-6)
    server = DPFedAvgServer(cfg, _init(), evaluate_fn=lambda p: (0.7, 0.5))
    votes = [ClientVote(1, [1, 0, 0])] * 3 + [ClientVote(1, [0, 0, 1])]
    votes += [ClientVote(n, [0, 1, 0]) for n in (2, 3)]
    server.initialise(votes)
    assert server.vote_counts == pytest.approx([1, 2, 0], abs=1e-3)  # not [3, 2, 1]
    assert server.votes_rejected == 3


def test_duplicate_replies_through_flower_messages_count_once():
    """The Flower adapter keeps each reply's node: a transport that delivers every reply
    three times (votes and updates) gives the run of one delivery."""

    class Tripled(LocalGrid):
        def send_and_receive(self, messages, *, timeout=None):
            return [r for r in super().send_and_receive(messages, timeout=timeout) for _ in "abc"]

    def run(grid_cls):
        cfg = _cfg(
            method="lac", num_clients=4, clients_per_round=4, rounds=1, initial_clip=10.0,
            vote_noise_std=1e-6,
        )  # fmt: skip
        server = DPFedAvgServer(cfg, _init(), evaluate_fn=lambda p: (1.0, 0.5))
        clients = {n: _fake_client(value=0.01) for n in range(4)}
        DPFedAvg(server, {}).start(grid_cls(clients, {n: {"partition-id": n} for n in range(4)}))
        return server

    once, tripled = run(LocalGrid), run(Tripled)
    assert tripled.vote_counts == pytest.approx(once.vote_counts, abs=1e-3)
    assert tripled.vote_counts == pytest.approx([0, 4, 0], abs=1e-3)
    for a, b in zip(tripled.params, once.params, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


# ------------------------------------------------------------------ forks


def test_a_fork_reports_the_epsilon_of_releasing_every_continuation(tmp_path):
    """Two rounds shared, then two continuations of three rounds each: releasing both costs
    2 + 3 + 3 sampled rounds, checked against dp-accounting directly."""
    import dp_accounting as dpa

    from dpfit.federated.cli import summary
    from dpfit.federated.client import TaskConfig

    cfg = _cfg(noise_multiplier=1.0, rounds=5, checkpoint_dir=str(tmp_path))
    replies = [ClientReply(i, _update(0.01), {}) for i in (1, 2)]
    first = DPFedAvgServer(cfg, _init())
    for _ in range(2):
        first.aggregate([1, 2], replies)
    assert first.continuation_report() is None
    a = DPFedAvgServer(cfg, _init())
    assert a.load_checkpoint(tmp_path)
    fork_cfg = _cfg(**{**cfg.__dict__, "checkpoint_dir": None, "allow_fork": True})
    b = DPFedAvgServer(fork_cfg, _init())
    assert b.load_checkpoint(tmp_path)
    for server in (a, b):
        for _ in range(3):
            server.aggregate([1, 2], replies)
    assert "epsilon_if_all_continuations_released" not in a.continuation_report()
    report = b.continuation_report()
    assert (report["continuation"], report["shared_rounds"], report["fork"]) == (2, 2, True)
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(4 / 10, dpa.GaussianDpEvent(1.0)), 2 + 3 * 2)
    want = acc.get_epsilon(1e-5)
    assert report["epsilon_if_all_continuations_released"] == pytest.approx(want, rel=1e-9)
    assert want > b.accountant.epsilon()  # this run alone: 5 rounds
    assert summary(b, TaskConfig(), 0.5, 0.7)["continuation"] == report

"""Client-level audit of DP-FedAvg: canary clients whose update is a fixed direction.

The server is the real transport-free core of the Flower strategy
(dpfit.federated.strategy.DPFedAvgServer): its Poisson client sampling, clip rule, noise and
client-level accountant. m canary clients each take part with probability 1/2 (an excluded one
stays in the population but sends a zero update, so N and q = m_round / N do not depend on the
draw); a present canary always sends scale * C * u_j, which the server clips to C u_j. Other
clients send random updates. The auditor reads every round's model change (what the server
broadcasts) and scores each canary exactly as the central white-box audit does.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from dpfit.audit.bounds import AuditError, best_bound, default_splits
from dpfit.audit.canaries import SCORES, draw_inclusion, scores_from_observations
from dpfit.audit.central import AuditResult
from dpfit.sampling import secure_seed


@dataclass(frozen=True)
class FederatedAuditConfig:
    epsilon: float = 8.0
    delta: float = 1e-5
    canaries: int = 1000
    other_clients: int = 100
    rounds: int = 1
    sample_rate: float = 1.0  # q: expected clients per round = q * N
    dim: int = 2048  # model size the canary directions live in (orthonormal when m <= dim)
    clip: float = 1.0
    canary_scale: float = 10.0
    method: str = "fixed"  # the server's clip rule; "fixed" is DP-FedAvg
    accountant: str = "rdp"
    score: str = "llr"
    splits: tuple[tuple[int, int], ...] = ()
    confidence: float = 0.95
    seed: int = 0  # public: directions, other clients' updates
    insecure_seed: int | None = None  # fixes client sampling, noise and inclusion (tests only)

    def __post_init__(self) -> None:
        if self.canaries < 2:
            raise AuditError(f"canaries must be >= 2, got {self.canaries}")
        if self.score not in SCORES:
            raise AuditError(f"score must be one of {SCORES}, got {self.score!r}")
        if not 0 < self.sample_rate <= 1:
            raise AuditError(f"sample_rate must be in (0, 1], got {self.sample_rate}")


def _server_config(cfg: FederatedAuditConfig, n: int):
    from dpfit.federated.strategy import ServerConfig

    kw = dict(
        method=cfg.method,
        num_clients=n,
        clients_per_round=cfg.sample_rate * n,
        rounds=cfg.rounds,
        target_epsilon=cfg.epsilon,
        delta=cfg.delta,
        initial_clip=cfg.clip,
        server_lr=1.0,
        accountant=cfg.accountant,
    )
    names = {f.name for f in dataclasses.fields(ServerConfig)}
    if "insecure_seed" in names:  # sampling and noise from OS randomness unless fixed
        kw["insecure_seed"] = cfg.insecure_seed
    else:  # older server: one seed drives sampling and noise; never a public one here
        kw["seed"] = secure_seed() if cfg.insecure_seed is None else cfg.insecure_seed
    return ServerConfig(**kw)


def federated_audit(cfg: FederatedAuditConfig) -> AuditResult:
    from dpfit.federated.strategy import ClientReply, DPFedAvgServer

    t0 = time.perf_counter()
    m = cfg.canaries
    included = draw_inclusion(m, None if cfg.insecure_seed is None else cfg.insecure_seed + 7)
    rng = np.random.default_rng(cfg.seed)
    g = rng.standard_normal((cfg.dim, m))
    u = np.linalg.qr(g)[0].T if m <= cfg.dim else (g / np.linalg.norm(g, axis=0)).T
    n = m + cfg.other_clients
    server = DPFedAvgServer(_server_config(cfg, n), [np.zeros(cfg.dim, dtype=np.float32)])
    server.initialise()
    ids = list(range(n))
    observed = []
    for _ in range(cfg.rounds):
        server.check_budget()
        sampled = server.sample_clients(ids)
        clip = server.rule.clip_norm
        replies = []
        for c in sampled:
            if c < m:
                vec = u[c] * cfg.canary_scale * clip if included[c] else np.zeros(cfg.dim)
            else:
                v = rng.standard_normal(cfg.dim)
                vec = v / np.linalg.norm(v) * clip * rng.uniform(0.1, 2.0)
            replies.append(ClientReply(c, [vec.astype(np.float32)]))
        before = server.params[0].astype(np.float64).copy()
        server.aggregate(sampled, replies)
        step = (
            (server.params[0] - before) * server.config.clients_per_round / server.config.server_lr
        )
        observed.append(torch.from_numpy(u @ step / clip))
    x = torch.stack(observed).float()
    q = server.config.sample_rate
    z = server.rule.update_multiplier
    scores = scores_from_observations(x, cfg.score, q, z)
    b = best_bound(
        scores.tolist(),
        included.tolist(),
        list(cfg.splits) or default_splits(m),
        cfg.delta,
        cfg.confidence,
    )
    return AuditResult(
        kind="federated",
        epsilon_claimed=server.accountant.epsilon(),
        epsilon_target=cfg.epsilon,
        delta=cfg.delta,
        epsilon_lower_bound=b.epsilon_lower_bound,
        confidence=cfg.confidence,
        epsilon_ceiling=b.ceiling,
        canaries=m,
        included=int(included.sum()),
        guesses=b.guesses,
        correct=b.correct,
        k_plus=b.k_plus,
        k_minus=b.k_minus,
        noise_multiplier=z,
        sample_rate=q,
        steps=server.round,
        score=cfg.score,
        seconds=time.perf_counter() - t0,
        tried=b.tried,
        scores=tuple(float(s) for s in scores),
        included_mask=tuple(bool(v) for v in included),
        notes=(f"DP-FedAvg server core, clip rule {cfg.method}, {n} clients",),
    )

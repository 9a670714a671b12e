"""Client-level audit of the DP-FedAvg server core: passes the real server, catches bad noise.

Faults are injected into the real server's clip rule (monkeypatch of FixedClip.update_noise_std,
undone after the test). Fixed insecure seeds; the margin is as in test_central.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

from dpfit.audit.federated import FederatedAuditConfig, federated_audit  # noqa: E402
from dpfit.federated.clipping import FixedClip  # noqa: E402


def run(eps: float, seed: int = 0, **kw):
    return federated_audit(
        FederatedAuditConfig(epsilon=eps, canaries=1000, dim=1024, insecure_seed=seed, **kw)
    )


@pytest.mark.parametrize("eps", [1.0, 8.0])
def test_correct_server_never_exceeds_claim(eps):
    for seed in range(2):
        r = run(eps, seed)
        assert r.epsilon_claimed <= eps + 1e-6 and not r.violated, r
    if eps == 8.0:
        assert r.epsilon_lower_bound > 0.25 * eps, r


def test_noise_on_the_mean_is_caught(monkeypatch):
    real = FixedClip.update_noise_std

    def on_mean(self):
        return real(self) / self.config.expected_clients

    monkeypatch.setattr(FixedClip, "update_noise_std", on_mean)
    r = run(2.0)
    assert r.epsilon_lower_bound > 1.25 * r.epsilon_claimed, r


def test_noise_ten_times_too_small_is_caught(monkeypatch):
    real = FixedClip.update_noise_std
    monkeypatch.setattr(FixedClip, "update_noise_std", lambda self: real(self) / 10)
    r = run(2.0)
    assert r.epsilon_lower_bound > 1.25 * r.epsilon_claimed, r

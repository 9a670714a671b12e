"""Empirical privacy audits: one training run, m canaries, a lower bound on epsilon.

bounds: the one-run bound (Steinke, Nasr, Jagielski 2023). canaries: inclusion, white-box
gradient canaries, scores. central: audits of the PrivacyEngine (white-box, black-box).
federated: client-level audit of the DP-FedAvg server. text: the bundled model and data.
Names are imported on first use so that `dpfit --help` stays fast.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AuditConfig": "central",
    "AuditResult": "central",
    "black_box_audit": "central",
    "white_box_audit": "central",
    "AuditError": "bounds",
    "epsilon_lower_bound": "bounds",
    "p_value": "bounds",
    "FederatedAuditConfig": "federated",
    "federated_audit": "federated",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"dpfit.audit.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'dpfit.audit' has no attribute {name!r}")

"""Empirical privacy audits: one training run, m canaries, a lower bound on epsilon.

bounds: the one-run bound (Steinke, Nasr, Jagielski 2023). canaries: inclusion, white-box
gradient canaries, scores. central: audits of the PrivacyEngine (white-box, black-box).
federated: client-level audit of the DP-FedAvg server. text: the bundled model and data.
"""

from dpfit.audit.bounds import AuditError, epsilon_lower_bound, p_value
from dpfit.audit.central import AuditConfig, AuditResult, black_box_audit, white_box_audit

__all__ = [
    "AuditConfig",
    "AuditError",
    "AuditResult",
    "black_box_audit",
    "epsilon_lower_bound",
    "p_value",
    "white_box_audit",
]

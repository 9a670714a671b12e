"""Kept so that scripts importing ``paired_t`` (utility, federated_misspec) still run; the
interval lives in harness.stats."""

from harness.stats import t_interval

__all__ = ["t_interval"]

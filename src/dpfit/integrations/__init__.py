"""Adapters to other libraries' training loops; each imports its library lazily."""

from __future__ import annotations

_EXPORTS = {
    "DPOptimizer": "trainer",
    "DPTrainer": "trainer",
    "MissingPrivacyStateError": "trainer",
    "NoCheckpointError": "trainer",
    "PrivacyArguments": "trainer",
    "LossInputs": "losses",
    "register_per_example_loss": "losses",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        from importlib import import_module

        return getattr(import_module(f"dpfit.integrations.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'dpfit.integrations' has no attribute {name!r}")

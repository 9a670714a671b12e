"""Adapters to other libraries' training loops; each imports its library lazily."""

from __future__ import annotations

__all__ = ["DPOptimizer", "DPTrainer", "PrivacyArguments"]


def __getattr__(name: str):
    if name in __all__:
        from dpfit.integrations import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'dpfit.integrations' has no attribute {name!r}")

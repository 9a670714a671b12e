"""Fixtures shared by the DPTrainer tests."""

from __future__ import annotations

import pytest

from dpfit import clipping


@pytest.fixture
def recorded_norms(monkeypatch):
    """A clipping rule, "test-recording", that records the per-example (or per-document)
    norms the engine clips."""
    seen = []

    def recording(norms, max_grad_norm):
        seen.append(norms.detach().clone())
        return clipping.flat(norms, max_grad_norm)

    monkeypatch.setitem(clipping._CLIP_FNS, "test-recording", recording)
    return seen

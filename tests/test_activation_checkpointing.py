"""Per-example bias gradients at 2,048 tokens, with and without activation checkpointing,
against the microbatch-of-one oracle (float64, 1e-5 relative).

Checkpointing recomputes each decoder layer in the backward pass; the rows must still be read
once per example from the differentiated forward (no double counting, no lost layer).
"""

from __future__ import annotations

import pytest
import torch
from long_llama import (
    T,
    assert_rows_match_oracle,
    long_batch,
    plain_loss_sum,
    saved_bytes,
    tiny_long_llama,
)
from oracle import make_engine

from dpfit.activation_checkpointing import enable_activation_checkpointing
from dpfit.errors import DPFitError

pytest.importorskip("transformers")


def _batch():
    return long_batch()


_loss_sum = plain_loss_sum


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_causal_lm_rows_match_oracle_at_2048_tokens(checkpointing):
    model = tiny_long_llama().train()
    batch = _batch()
    assert batch["input_ids"].shape == (3, T)
    assert_rows_match_oracle(model, batch, plain_loss_sum, checkpointing)


def test_checkpointing_step_matches_plain_step():
    """One private step (noise 0, clipping active) releases the same update either way."""
    released = []
    for checkpointing in (False, True):
        model = tiny_long_llama().train()
        if checkpointing:
            enable_activation_checkpointing(model, "bias")
        engine = make_engine(model, max_grad_norm=1e-3, expected_batch_size=3)
        from oracle import Capture

        opt = Capture(engine.parameters())
        _loss_sum(model, _batch()).backward()
        engine.step(opt, batch_size=3)
        released.append(torch.cat([opt.grads[p].flatten() for p in engine.parameters()]))
        engine.detach()
    scale = released[0].abs().max()
    assert ((released[0] - released[1]).abs().max() / scale) <= 1e-5


def test_checkpointing_refused_outside_bias_mode():
    model = tiny_long_llama()
    with pytest.raises(DPFitError, match="--mode bias"):
        enable_activation_checkpointing(model, "full")


def test_checkpointing_refused_for_a_model_without_it():
    with pytest.raises(DPFitError, match="no activation checkpointing"):
        enable_activation_checkpointing(torch.nn.Linear(2, 2), "bias")


def _saved_bytes(model, batch) -> int:
    """Bytes autograd keeps from the forward for the backward (what checkpointing cuts)."""
    total = saved_bytes(lambda: _loss_sum(model, batch))
    model.zero_grad(set_to_none=True)
    return total


def test_checkpointing_keeps_fewer_activations_under_the_engine():
    """The memory trade-off is real with the engine's hooks on: the decoder layers' saved
    activations are recomputed, not kept."""
    batch = _batch()
    kept = []
    for checkpointing in (False, True):
        model = tiny_long_llama().train()
        if checkpointing:
            enable_activation_checkpointing(model, "bias")
        engine = make_engine(model, check_gradients=False)
        kept.append(_saved_bytes(model, batch))
        engine.detach()
    assert kept[1] < 0.5 * kept[0], kept

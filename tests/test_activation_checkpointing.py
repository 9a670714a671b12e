"""Per-example bias gradients at 2,048 tokens, with and without activation checkpointing,
against the microbatch-of-one oracle (float64, 1e-5 relative).

Checkpointing recomputes each decoder layer in the backward pass; the rows must still be read
once per example from the differentiated forward (no double counting, no lost layer).
"""

from __future__ import annotations

import pytest
import torch
from long_llama import T, tiny_long_llama, token_ids
from oracle import assert_matches_oracle, engine_per_example, make_engine, oracle_per_example

from dpfit.activation_checkpointing import enable_activation_checkpointing
from dpfit.causal_lm import Window, make_collate, per_example_token_nll
from dpfit.errors import DPFitError

pytest.importorskip("transformers")

# three examples at the full length, one of them padded (a shorter text in the batch)
LENGTHS = (T, T - 700, T)


def _batch():
    items = [Window(token_ids(n, seed=i)) for i, n in enumerate(LENGTHS)]
    return make_collate(0)(items)


def _loss_sum(model, batch) -> torch.Tensor:
    """Sum over examples of each example's mean token NLL (loss_reduction='sum')."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    total, count = per_example_token_nll(logits, batch["labels"])
    return (total / count.clamp(min=1)).sum()


def _oracle(model, batch):
    def one(i: int) -> torch.Tensor:
        n = int(batch["attention_mask"][i].sum())
        alone = {k: v[i : i + 1, :n] for k, v in batch.items()}
        return _loss_sum(model, alone)

    return oracle_per_example(model, one, len(LENGTHS))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_causal_lm_rows_match_oracle_at_2048_tokens(checkpointing):
    model = tiny_long_llama().train()
    batch = _batch()
    assert batch["input_ids"].shape == (3, T)
    want = _oracle(model, batch)  # each example alone, no checkpointing
    if checkpointing:
        enable_activation_checkpointing(model, "bias")
        assert model.model.gradient_checkpointing and model.model.layers[0].gradient_checkpointing
    engine = make_engine(model)  # check_gradients on: rows must add up to autograd's .grad
    got = engine_per_example(engine, lambda: _loss_sum(model, batch))
    assert_matches_oracle(got, want)
    assert len(got) == sum(p.requires_grad for p in model.parameters())
    engine.detach()


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
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss_sum(model, batch)
    loss.backward()
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

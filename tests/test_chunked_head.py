"""The chunked causal-LM loss (dpfit.chunked_head): the same per-example losses and the same
per-example bias gradients as the one-piece loss, against the microbatch-of-one oracle at
2,048 tokens (float64, 1e-5 relative), with and without activation checkpointing; far fewer
bytes kept for the backward; refusals for models it would get wrong."""

from __future__ import annotations

import pytest
import torch
from long_llama import (
    LENGTHS,
    assert_rows_match_oracle,
    long_batch,
    saved_bytes,
    tiny_long_llama,
)

from dpfit.causal_lm import per_example_token_nll
from dpfit.chunked_head import chunk_positions, chunked_token_nll
from dpfit.errors import DPFitError

pytest.importorskip("transformers")

# a budget of 300 positions per chunk for 3 examples of the tiny model's 64 classes: 7 chunks,
# the last one partial (2,047 predicted positions)
BUDGET = 300 * 4 * 3 * 64


def _batch(lengths=LENGTHS):
    return long_batch(lengths)


def _plain(model, batch):
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return per_example_token_nll(logits, batch["labels"])


def _chunked_sum(model, batch):
    total, count = chunked_token_nll(model, batch, BUDGET)
    return (total / count.clamp(min=1)).sum()


def test_chunks_cover_every_position():
    assert chunk_positions(3, 64, BUDGET) == 300
    assert 2047 % 300 != 0  # the last chunk is partial


def test_same_losses_as_the_full_logits():
    model = tiny_long_llama().train()
    batch = _batch()
    want_total, want_count = _plain(model, batch)
    got_total, got_count = chunked_token_nll(model, batch, BUDGET)
    assert torch.equal(got_count, want_count)
    torch.testing.assert_close(got_total, want_total.to(got_total.dtype), rtol=1e-10, atol=0)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_rows_match_oracle_at_2048_tokens(checkpointing):
    assert_rows_match_oracle(tiny_long_llama().train(), _batch(), _chunked_sum, checkpointing)


def _big_vocab_llama():
    """Logits that dominate memory, as a real vocabulary's do at long T."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.requires_grad_(False)
    model.model.norm.weight.requires_grad_(True)
    return model.train()


def test_keeps_no_full_logits_for_the_backward():
    model = _big_vocab_llama()
    ids = torch.randint(0, 4096, (2, 512))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    logits_bytes = 2 * 511 * 4096 * 4
    plain = saved_bytes(lambda: _plain(model, batch)[0].sum())
    chunked = saved_bytes(
        lambda: chunked_token_nll(model, batch, budget=2 * 64 * 4096 * 4)[0].sum()
    )
    assert plain > logits_bytes  # the one-piece loss keeps at least one full copy
    assert chunked < 0.1 * logits_bytes, (plain, chunked)


def test_refuses_a_model_that_changes_logits_after_its_head():
    from transformers import LlamaForCausalLM

    class Scaled(LlamaForCausalLM):
        def forward(self, input_ids=None, logits_to_keep=0, **kwargs):
            out = super().forward(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
            out.logits = 0.5 * out.logits  # a logit scale, as Cohere models have
            return out

    base = _big_vocab_llama()
    model = Scaled(base.config)
    model.requires_grad_(False)
    with pytest.raises(DPFitError, match="after the output head"):
        chunked_token_nll(model, _batch((16, 16)))


def test_refuses_a_trained_head_and_a_model_without_parts():
    model = _big_vocab_llama()
    model.lm_head.weight.requires_grad_(True)
    with pytest.raises(DPFitError, match="head trains"):
        chunked_token_nll(model, _batch((16, 16)))
    with pytest.raises(DPFitError, match="in chunks"):
        chunked_token_nll(torch.nn.Linear(2, 2), _batch((16, 16)))

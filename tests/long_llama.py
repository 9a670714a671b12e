"""Shared pieces of the long-input tests: a tiny LLaMA-style model that reads 2,048 tokens, in
float64, with DP-BiTFiT-Add biases (so the oracle comparisons are cheap on a CPU)."""

from __future__ import annotations

import torch

import dpfit

T = 2048  # the length the oracle tests run at


def tiny_long_llama(seed: int = 0, dtype: torch.dtype = torch.float64):
    """2 layers, hidden 16, 2,048 positions, biases added (and trainable) everywhere."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
        tie_word_embeddings=True, eos_token_id=1, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).to(dtype)
    dpfit.add_biases(model)
    for p in model.parameters():  # non-zero biases: every layer's gradient path is exercised
        if p.requires_grad and p.dim() == 1 and p.abs().sum() == 0:
            with torch.no_grad():
                p.normal_(0, 0.1)
    dpfit.make_bias_trainable(model)
    return model


def token_ids(length: int, seed: int) -> torch.Tensor:
    """A deterministic token sequence of `length` ids in [2, 64)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 64, (length,), generator=g)

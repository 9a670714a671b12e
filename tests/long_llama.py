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


# three examples at the full length, one of them padded (a shorter text in the batch)
LENGTHS = (T, T - 700, T)


def long_batch(lengths=LENGTHS) -> dict:
    """A collated causal-LM batch of deterministic token sequences of these lengths."""
    from dpfit.causal_lm import Window, make_collate

    return make_collate(0)([Window(token_ids(n, seed=i)) for i, n in enumerate(lengths)])


def plain_loss_sum(model, batch) -> torch.Tensor:
    """Sum over examples of each example's mean token NLL, from the whole logits."""
    from dpfit.causal_lm import per_example_token_nll

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    total, count = per_example_token_nll(logits, batch["labels"])
    return (total / count.clamp(min=1)).sum()


def assert_rows_match_oracle(model, batch, loss_sum, checkpointing: bool) -> None:
    """The engine's per-example rows under `loss_sum` (optionally with activation
    checkpointing) against each example run alone through the plain loss (float64, 1e-5)."""
    from oracle import assert_matches_oracle, engine_per_example, make_engine, oracle_per_example

    from dpfit.activation_checkpointing import enable_activation_checkpointing

    def one(i: int) -> torch.Tensor:
        n = int(batch["attention_mask"][i].sum())
        return plain_loss_sum(model, {k: v[i : i + 1, :n] for k, v in batch.items()})

    want = oracle_per_example(model, one, batch["input_ids"].shape[0])
    if checkpointing:
        enable_activation_checkpointing(model, "bias")
        assert model.model.gradient_checkpointing and model.model.layers[0].gradient_checkpointing
    engine = make_engine(model)  # check_gradients on: rows must add up to autograd's .grad
    got = engine_per_example(engine, lambda: loss_sum(model, batch))
    assert_matches_oracle(got, want)
    assert len(got) == sum(p.requires_grad for p in model.parameters())
    engine.detach()


def saved_bytes(loss_fn) -> int:
    """Bytes autograd keeps from the forward for the backward of `loss_fn()`."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    loss.backward()
    return total

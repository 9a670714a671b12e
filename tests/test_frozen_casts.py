"""Frozen weights cast to bf16 once per run (dpfit.frozen_casts): bit for bit what autocast
computes when it casts them on every call, and the model is float32 again outside a step."""

from __future__ import annotations

import pytest
import torch
from oracle import engine_per_example, make_engine
from torch import nn

import dpfit
from dpfit import precision
from dpfit.frozen_casts import FrozenWeightCasts
from dpfit.grad_sample.full import OuterGrad
from dpfit.params import add_lora, make_lora_trainable

transformers = pytest.importorskip("transformers")

B, T = 4, 9


def _bert() -> nn.Module:
    cfg = transformers.BertConfig(
        vocab_size=200,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(cfg).train()
    dpfit.make_bias_trainable(model, train_head=("classifier",))
    return model


def _gpt2() -> nn.Module:
    """Conv1D layers (x @ W + b through addmm)."""
    cfg = transformers.GPT2Config(
        vocab_size=200, n_embd=64, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, num_labels=2, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2ForSequenceClassification(cfg).train()
    dpfit.make_bias_trainable(model, train_head=("score",))
    return model


def _bert_bias_lora() -> nn.Module:
    """peft LoRA on query/value: the adapted layers' frozen base weights are swapped, the
    adapters (trainable, float32) are not."""
    peft = pytest.importorskip("peft")
    model = _bert()
    for p in model.parameters():
        p.requires_grad_(False)
    add_lora(model, r=4, alpha=8.0)
    for n, p in model.named_parameters():
        if "lora_B" in n:  # peft starts lora_B at zero: move it off, so lora_A gets gradients
            nn.init.normal_(p, std=0.2)
    make_lora_trainable(model, biases=True)
    assert any(isinstance(m, peft.tuners.lora.LoraLayer) for m in model.modules())
    return model


MODELS = {
    "bert": (_bert, "bias"),
    "gpt2": (_gpt2, "bias"),
    "bert-bias+lora": (_bert_bias_lora, "bias+lora"),
}


def _dense(g) -> torch.Tensor:
    """A per-example row as a plain tensor (LoRA adapters' rows are factored)."""
    return g.materialize() if isinstance(g, OuterGrad) else g


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 200, (B, T), generator=g), torch.randint(0, 2, (B,), generator=g)


def _per_example_and_grads(model, casts: FrozenWeightCasts | None, mode: str = "bias"):
    ids, labels = _data()
    engine = make_engine(model, mode=mode)

    def batch_loss() -> torch.Tensor:
        with precision.autocast("bf16", "cpu"):
            logits = model(input_ids=ids).logits
            return nn.functional.cross_entropy(logits, labels, reduction="sum")

    grads = {}

    def loss_keeping_grads() -> torch.Tensor:
        loss = batch_loss()
        for n, p in model.named_parameters():  # .grad as autograd leaves it, via hooks
            if p.requires_grad:
                p.register_hook(lambda g, n=n: grads.__setitem__(n, g.clone()))
        return loss

    try:
        if casts is None:
            per = engine_per_example(engine, loss_keeping_grads)
        else:
            with casts.active():
                per = engine_per_example(engine, loss_keeping_grads)
    finally:
        engine.detach()
    return per, grads


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cached_casts_change_nothing_that_is_computed(name):
    """Per-example rows and autograd's gradients, with and without the cached casts: equal
    bit for bit (the copy is the cast autocast makes on every call)."""
    build, mode = MODELS[name]
    model = build()
    want_rows, want_grads = _per_example_and_grads(model, None, mode)
    casts = FrozenWeightCasts(model, "bf16", "cpu")
    # BERT: 6 products a layer (Q K V O, FFN in/out; under LoRA the base layers') and the
    # pooler, + the head where it does not train (LoRA here); GPT-2: 4 a layer
    assert len(casts.frozen_weights()) == {"bert": 13, "gpt2": 8, "bert-bias+lora": 14}[name]
    for _ in range(2):  # the second step reuses the copies
        got_rows, got_grads = _per_example_and_grads(model, casts, mode)
        assert set(got_rows) == set(want_rows) and set(got_grads) == set(want_grads)
        for n in want_rows:
            got, want = _dense(got_rows[n]), _dense(want_rows[n])
            assert got.dtype == torch.float32
            assert torch.equal(got, want), n
        for n in want_grads:
            assert torch.equal(got_grads[n], want_grads[n]), n


def test_only_frozen_matmul_weights_are_swapped_and_all_come_back():
    model = _bert()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    casts = FrozenWeightCasts(model, "bf16", "cpu")
    frozen = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, nn.Linear) and not m.weight.requires_grad
    }
    assert len(frozen) == 13
    with casts.active():
        for n, p in model.named_parameters():
            want = torch.bfloat16 if id(p) in frozen else torch.float32
            assert p.dtype == want, (n, p.dtype)
        assert model.classifier.weight.dtype == torch.float32  # trainable: a float32 master
        assert model.bert.embeddings.word_embeddings.weight.dtype == torch.float32
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, before[n]), n
    with pytest.raises(RuntimeError, match="boom"), casts.active():
        raise RuntimeError("boom")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_a_weight_tied_to_an_embedding_stays_float32():
    emb = nn.Embedding(10, 8)
    head = nn.Linear(8, 10, bias=False)
    head.weight = emb.weight  # tied, as a causal LM's output layer
    other = nn.Linear(8, 8)
    model = nn.ModuleDict({"emb": emb, "head": head, "other": other}).requires_grad_(False)
    casts = FrozenWeightCasts(model, "bf16", "cpu")
    assert casts.frozen_weights() == [other.weight]
    with casts.active():
        assert emb.weight.dtype == torch.float32 and other.weight.dtype == torch.bfloat16


def test_a_frozen_weight_changed_in_place_is_cast_again():
    lin = nn.Linear(8, 8).requires_grad_(False)
    casts = FrozenWeightCasts(lin, "bf16", "cpu")
    with casts.active():
        first = lin.weight.detach().clone()
    with torch.no_grad():
        lin.weight.add_(1.0)
    want = lin.weight.detach().bfloat16()
    assert not torch.equal(want, first)
    with casts.active():
        assert torch.equal(lin.weight, want)


def test_a_frozen_weight_given_new_storage_is_cast_again():
    """One instance serves a run's phases: a weight whose data was replaced (a checkpoint
    loaded into `.data`, say) gets a fresh copy even where the version counter did not move."""
    lin = nn.Linear(8, 8).requires_grad_(False)
    casts = FrozenWeightCasts(lin, "bf16", "cpu")
    with casts.active():
        first = lin.weight.detach().clone()
    lin.weight.data = lin.weight.data + 1.0
    want = lin.weight.detach().bfloat16()
    assert not torch.equal(want, first)
    with casts.active():
        assert torch.equal(lin.weight, want)


def test_unfrozen_weights_are_no_longer_swapped():
    lin = nn.Linear(8, 8).requires_grad_(False)
    casts = FrozenWeightCasts(lin, "bf16", "cpu")
    with casts.active():
        assert lin.weight.dtype == torch.bfloat16
    lin.weight.requires_grad_(True)  # a full phase, say
    with casts.active():
        assert lin.weight.dtype == torch.float32


def test_fp32_is_a_no_op():
    lin = nn.Linear(8, 8).requires_grad_(False)
    casts = FrozenWeightCasts(lin, "fp32", "cpu")
    assert casts.dtype is None
    with casts.active():
        assert lin.weight.dtype == torch.float32

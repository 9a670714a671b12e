"""Whole models from transformers configs (random init) against the microbatch-of-one oracle."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_matches_oracle, engine_per_example, make_engine, oracle_per_example
from torch import nn

import dpfit

transformers = pytest.importorskip("transformers")

B, T = 3, 7
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
SMALL_ENCODER = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
)


def bert_minilm_sized(kernel: str = "sdpa"):
    cfg = transformers.BertConfig(
        vocab_size=200,
        hidden_size=384,
        num_hidden_layers=2,
        num_attention_heads=12,
        intermediate_size=1536,
        num_labels=2,
        attn_implementation=kernel,
        **NO_DROPOUT,
    )
    return transformers.BertForSequenceClassification(cfg), "classifier"


def roberta():
    cfg = transformers.RobertaConfig(
        vocab_size=200, max_position_embeddings=40, num_labels=3, **SMALL_ENCODER, **NO_DROPOUT
    )
    return transformers.RobertaForSequenceClassification(cfg), "classifier"


def gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=200,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=40,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        num_labels=2,
        pad_token_id=0,
    )
    return transformers.GPT2ForSequenceClassification(cfg), "score"


TEXT_MODELS = {
    "bert": bert_minilm_sized,
    # the kernel `dpfit train` runs a text classifier with on CPU in bf16 (dpfit.attention)
    "bert-eager-attention": lambda: bert_minilm_sized("eager"),
    "roberta": roberta,
    "gpt2": gpt2,
}


@pytest.mark.parametrize("name", sorted(TEXT_MODELS))
def test_text_model_matches_oracle(name):
    model, head = TEXT_MODELS[name]()
    model = model.double().train()
    dpfit.make_bias_trainable(model, train_head=(head,))
    ids = torch.randint(3, 200, (B, T))
    labels = torch.randint(0, model.config.num_labels, (B,))

    def loss(sl: slice) -> torch.Tensor:
        out = model(input_ids=ids[sl], labels=None).logits
        return nn.functional.cross_entropy(out, labels[sl], reduction="sum")

    want = oracle_per_example(model, lambda i: loss(slice(i, i + 1)), B)
    engine = make_engine(model)
    got = engine_per_example(engine, lambda: loss(slice(None)))
    assert_matches_oracle(got, want)
    # the head's weight is trained too (new classifier), everything else is a bias
    assert any(n.startswith(head) and n.endswith("weight") for n in got)


def test_vit_matches_oracle():
    cfg = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, num_labels=5, **SMALL_ENCODER, **NO_DROPOUT
    )
    model = transformers.ViTForImageClassification(cfg).double().train()
    dpfit.make_bias_trainable(model, train_head=("classifier",))
    x = torch.randn(B, 3, 16, 16, dtype=torch.double)
    y = torch.randint(0, 5, (B,))

    def loss(sl):
        return nn.functional.cross_entropy(model(pixel_values=x[sl]).logits, y[sl], reduction="sum")

    want = oracle_per_example(model, lambda i: loss(slice(i, i + 1)), B)
    got = engine_per_example(make_engine(model), lambda: loss(slice(None)))
    assert_matches_oracle(got, want)
    assert "vit.embeddings.patch_embeddings.projection.bias" in got  # a Conv2d bias


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.GroupNorm(2, 8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2),
            nn.GroupNorm(4, 8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


def test_cnn_with_groupnorm_matches_oracle():
    model = SmallCNN().double()
    dpfit.make_bias_trainable(model, train_head=("head",))
    x = torch.randn(4, 3, 9, 9, dtype=torch.double)
    y = torch.randint(0, 4, (4,))

    def loss(sl):
        return nn.functional.cross_entropy(model(x[sl]), y[sl], reduction="sum")

    want = oracle_per_example(model, lambda i: loss(slice(i, i + 1)), 4)
    got = engine_per_example(make_engine(model), lambda: loss(slice(None)))
    assert_matches_oracle(got, want)


def test_tied_bias_module_used_in_two_places():
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared)  # same module twice: tied parameters
    dpfit.make_bias_trainable(model)
    model = model.double()
    x = torch.randn(5, 3, 4, dtype=torch.double)
    want = oracle_per_example(model, lambda i: model(x[i : i + 1]).pow(2).sum(), 5)
    got = engine_per_example(make_engine(model), lambda: model(x).pow(2).sum())
    assert_matches_oracle(got, want)


def test_bias_tied_across_two_modules():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.bias = self.a.bias  # one Parameter, two modules

        def forward(self, x):
            return self.b(torch.tanh(self.a(x)))

    model = TwoHeads()
    dpfit.make_bias_trainable(model)
    model = model.double()
    x = torch.randn(5, 2, 4, dtype=torch.double)
    want = oracle_per_example(model, lambda i: model(x[i : i + 1]).pow(3).sum(), 5)
    got = engine_per_example(make_engine(model), lambda: model(x).pow(3).sum())
    assert_matches_oracle(got, want)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_is_exact(reentrant):
    """Recomputed forwards (activation checkpointing) neither lose nor double-count examples."""
    cfg = transformers.BertConfig(vocab_size=100, **SMALL_ENCODER, **NO_DROPOUT)
    model = transformers.BertForSequenceClassification(cfg).double().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    dpfit.make_bias_trainable(model, train_head=("classifier",))
    ids = torch.randint(0, 100, (3, 6))
    y = torch.randint(0, 2, (3,))

    def loss(sl):
        logits = model(input_ids=ids[sl]).logits
        return nn.functional.cross_entropy(logits, y[sl], reduction="sum")

    want = oracle_per_example(model, lambda i: loss(slice(i, i + 1)), 3)
    got = engine_per_example(make_engine(model), lambda: loss(slice(None)))
    assert_matches_oracle(got, want)

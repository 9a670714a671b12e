"""The batched engine in local mode ``bias`` (DP-BiTFiT clients: every bias and the head)
equals the per-client path: every client's update, loss and vote losses to 1e-6 in float64
(tiny random BERT with its trained pooler, uneven client sizes so some clients sit out a
step), and a whole run equals the in-process Flower run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from batched_clients import (
    assert_losses_votes_evaluation_match,
    assert_updates_match,
)

from dpfit.federated.app import initial_arrays, run_local
from dpfit.federated.batched import run_batched
from dpfit.federated.batched_layers import BatchedEngineError, trained_top
from dpfit.federated.batched_layers.bert_bias import BertBias
from dpfit.federated.client import (
    TaskConfig,
    load_local_model,
)
from dpfit.federated.strategy import ServerConfig
from dpfit.models import save_tiny_random_model

TOL = 1e-6


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return str(save_tiny_random_model(tmp_path_factory.mktemp("bert"), arch="bert"))


@pytest.fixture(scope="module")
def bert_mean(tmp_path_factory):
    """Mean pooling (a sentence-transformers folder, as the bundled MiniLM): no pooler."""
    folder = tmp_path_factory.mktemp("bert_mean")
    return str(save_tiny_random_model(folder, arch="bert", sentence_pooling="mean"))


def _task(bert: str, optimizer: str) -> TaskConfig:
    return TaskConfig(
        model=bert, local_mode="bias", max_length=16, local_epochs=2, local_batch_size=3,
        lr=0.05, local_optimizer=optimizer,
    )  # fmt: skip


def test_bias_mode_trains_every_bias_of_every_layer(bert):
    """The check below covers the embedding LayerNorm, every encoder layer and the pooler."""
    lm = load_local_model(bert, "bias", 4, 0, "float64")
    top = trained_top(lm)
    assert isinstance(top, BertBias) and top.qkv_weight is None
    assert "backbone.embeddings.LayerNorm.bias" in lm.trainable
    assert "backbone.pooler.dense.bias" in lm.trainable
    layers = len(lm.model.backbone.encoder.layer)
    assert layers >= 2 and len(top.layers) == layers
    for i in range(layers):
        assert sum(n.startswith(f"backbone.encoder.layer.{i}.") for n in lm.trainable) == 8


@pytest.mark.parametrize(
    "optimizer, pooling", [("adamw", "pooler"), ("sgd", "pooler"), ("adamw", "mean")]
)
def test_each_client_update_equals_the_per_client_path(bert, bert_mean, optimizer, pooling):
    model = bert if pooling == "pooler" else bert_mean
    lm = load_local_model(model, "bias", 4, 0, "float64")
    assert lm.model.pooling == pooling
    assert_updates_match(lm, _task(model, optimizer), TOL, no_gradient=("key.bias",))


def test_losses_votes_and_evaluation_equal_the_per_client_path(bert):
    """Each client at its own point: every bias differs between clients."""
    lm = load_local_model(bert, "bias", 4, 0, "float64")
    assert_losses_votes_evaluation_match(lm, _task(bert, "adamw"), TOL, apart=True)


def test_bias_mode_refuses_embeddings_bert_does_not_add(bert, tmp_path):
    """RoBERTa counts positions from its padding index: the embedding sum the engine caches
    would be wrong, so the model is refused (a BERT checkpoint passes the same check)."""
    import shutil

    from transformers import AutoConfig, RobertaConfig, RobertaModel

    bert_config = AutoConfig.from_pretrained(bert)
    config = RobertaConfig(
        vocab_size=bert_config.vocab_size, hidden_size=16, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=32, max_position_embeddings=66, pad_token_id=0,
    )  # fmt: skip
    RobertaModel(config).save_pretrained(tmp_path)
    for f in Path(bert).glob("*token*"):
        shutil.copy(f, tmp_path)
    lm = load_local_model(str(tmp_path), "bias", 4, 0, "float64")
    with pytest.raises(BatchedEngineError, match="RobertaEmbeddings"):
        trained_top(lm)


def test_bias_mode_refuses_cached_qkv_products(bert):
    lm = load_local_model(bert, "bias", 4, 0, "float64")
    top = trained_top(lm)
    hidden = torch.zeros(1, 1, 3, lm.model.config.hidden_size, dtype=torch.float64)
    params = {n: torch.as_tensor(a)[None] for n, a in zip(lm.trainable, lm.initial, strict=True)}
    with pytest.raises(BatchedEngineError, match="q/k/v"):
        top.logits(hidden, None, params, torch.zeros(1, 1, 3, 3 * hidden.shape[-1]))


@pytest.mark.parametrize("method", ["clac", "lac"])
def test_a_whole_run_equals_the_in_process_flower_run(bert, method):
    """Same sampling, votes, client losses, clipping and noise: the same model (float32)."""
    task = TaskConfig(
        model=bert, local_mode="bias", max_length=16, local_epochs=1, local_batch_size=4,
        lr=0.05, num_clients=8, examples_per_client=5, eval_examples=8,
    )  # fmt: skip
    cfg = ServerConfig(
        method=method, num_clients=8, clients_per_round=4, rounds=3, target_epsilon=None,
        noise_multiplier=0.5, initial_clip=0.5, insecure_seed=3,
    )  # fmt: skip
    flower = run_local(cfg, task)
    batched = run_batched(cfg, task)
    assert [r.clip_norm for r in batched.history] == pytest.approx(
        [r.clip_norm for r in flower.history], rel=1e-5
    )
    assert batched.vote_counts == pytest.approx(flower.vote_counts, abs=1e-9)
    start = initial_arrays(task)
    for a, b in zip(batched.params, flower.params, strict=True):
        # float32 here (the exact check is float64 above): AdamW's normalisation amplifies
        # rounding where a gradient is near zero
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=3e-4)
    assert any(not np.allclose(a, s) for a, s in zip(batched.params, start, strict=True))

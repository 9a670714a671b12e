"""The batched engine on a LLaMA-style decoder (local mode lora-top) equals the per-client
path: every client's update, loss and vote losses, and the server's evaluation, to 1e-6 in
float64 (tiny random LLaMA, uneven client sizes so some clients sit out a step), and a whole
run equals the in-process Flower run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from batched_clients import (
    assert_losses_votes_evaluation_match,
    assert_updates_match,
    perturbed_start,
    random_clients,
)

from dpfit.federated.app import initial_arrays, run_local
from dpfit.federated.batched import BatchedClients, run_batched
from dpfit.federated.batched_layers import BatchedEngineError, trained_top
from dpfit.federated.batched_layers.bert import BertTop
from dpfit.federated.batched_layers.llama import LlamaTop
from dpfit.federated.client import (
    ClientTaskError,
    TaskConfig,
    evaluate,
    load_local_model,
    top_layer_prefix,
)
from dpfit.federated.strategy import ServerConfig
from dpfit.models import save_tiny_random_model

TOL = 1e-6


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny random LLaMA, rebuilt with grouped-query attention (4 query heads share 2
    key/value heads, as SmolLM2's 9 share 3) and 3 layers."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    folder = save_tiny_random_model(tmp_path_factory.mktemp("llama"), arch="llama")
    cfg = LlamaConfig.from_pretrained(folder)
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers = 4, 2, 3
    torch.manual_seed(0)
    LlamaForSequenceClassification(cfg).save_pretrained(folder)
    return str(folder)


def _task(model: str, optimizer: str) -> TaskConfig:
    return TaskConfig(
        model=model, local_mode="lora-top", lora_r=4, max_length=16, local_epochs=2,
        local_batch_size=3, lr=0.05, local_optimizer=optimizer,
    )  # fmt: skip


def test_lora_top_trains_the_top_decoder_layers_lora_and_the_head_only(llama):
    """Per-client path: LoRA on q_proj/v_proj of the top layer (index 2 of 3) + the head;
    LLaMA has no biases, so nothing else trains."""
    lm = load_local_model(llama, "lora-top", 4, 0)
    top = "backbone.layers.2.self_attn."
    assert lm.trainable == [
        f"{top}{proj}.lora_{ab}.default.weight" for proj in ("q_proj", "v_proj") for ab in "AB"
    ] + ["head.weight", "head.bias"]
    assert top_layer_prefix(lm.model) == "backbone.layers.2."
    lower = [n for n, _ in lm.model.named_parameters() if "lora_" in n and top not in n]
    assert lower == []


def test_lora_top_refuses_a_model_without_a_known_layer_stack(tmp_path):
    gpt2 = str(save_tiny_random_model(tmp_path / "gpt2", arch="gpt2"))
    with pytest.raises(ClientTaskError, match="LLaMA-style decoder"):
        load_local_model(gpt2, "lora-top", 4, 0)


def test_the_family_table_runs_a_llama_in_lora_top_mode(llama):
    lm = load_local_model(llama, "lora-top", 4, 0, "float64")
    assert isinstance(trained_top(lm), LlamaTop)


def test_the_bert_families_refuse_a_decoder_with_mean_pooling(llama):
    """Mean pooling passes BertTop's pooling check: the encoder check must refuse it (an
    AttributeError before), so the table falls through to LlamaTop."""
    lm = load_local_model(llama, "lora-top", 4, 0, "float64")
    lm.model.pooling = "mean"  # the cached model: restored below
    try:
        with pytest.raises(BatchedEngineError, match="BERT-style encoder"):
            BertTop(lm)
        assert isinstance(trained_top(lm), LlamaTop)
    finally:
        lm.model.pooling = "last"


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_each_client_update_equals_the_per_client_path(llama, optimizer):
    lm = load_local_model(llama, "lora-top", 4, 0, "float64")
    assert_updates_match(lm, _task(llama, optimizer), TOL)


def test_losses_votes_and_evaluation_equal_the_per_client_path(llama):
    lm = load_local_model(llama, "lora-top", 4, 0, "float64")
    assert_losses_votes_evaluation_match(lm, _task(llama, "adamw"), TOL)


def test_each_client_reads_its_own_lora(llama):
    """Clients with different LoRA factors get their own models' losses in one call."""
    lm = load_local_model(llama, "lora-top", 4, 0, "float64")
    data = random_clients([5, 4, 6], seed=5)
    engine = BatchedClients(lm, _task(llama, "sgd"), lambda p: data[p])
    engine.cache.fill([e.text for d in data for e in d])
    clients = [perturbed_start(lm, seed=10 + p) for p in range(len(data))]
    stacked = [torch.as_tensor(np.stack(arrs)) for arrs in zip(*clients, strict=True)]
    mine = engine.mean_losses(stacked, data)
    for p, d in enumerate(data):
        lm.set_arrays(clients[p])
        ref = evaluate(lm, [e.text for e in d], [e.label for e in d], 16)[0]
        assert mine[p] == pytest.approx(ref, abs=TOL)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_other_poolings_equal_the_per_client_path(llama, pooling):
    """Mean pooling reads every position (so the causal mask matters), cls the first."""
    lm = load_local_model(llama, "lora-top", 4, 0, "float64")
    data = random_clients([5, 4], seed=6)
    start = perturbed_start(lm, seed=4)
    lm.model.pooling = pooling  # the cached model: restored below
    try:
        engine = BatchedClients(lm, _task(llama, "sgd"), lambda p: data[p])
        engine.cache.fill([e.text for d in data for e in d])
        mine = engine.mean_losses(engine._stack(start, len(data)), data)
        lm.set_arrays(start)
        for p, d in enumerate(data):
            ref = evaluate(lm, [e.text for e in d], [e.label for e in d], 16)[0]
            assert mine[p] == pytest.approx(ref, abs=TOL)
    finally:
        lm.model.pooling = "last"


def test_padded_batches_give_the_unpadded_logits(llama):
    """``logits`` with a right-padding mask equals it on each text alone (the engine passes
    no mask today; the family's contract allows one)."""
    lm = load_local_model(llama, "lora-top", 4, 0, "float64")
    top = trained_top(lm)
    texts = [e.text for e in random_clients([4], seed=8)[0]]
    ids = lm.encode(texts, 16)
    batch = lm.batch(ids)
    hidden = top.frozen_hidden(batch)
    named = dict(zip(lm.trainable, (torch.as_tensor(a) for a in perturbed_start(lm)), strict=True))
    padded = top.logits(hidden[None], batch["attention_mask"][None], named)[0]
    for row, x in enumerate(ids):
        alone = top.logits(hidden[None, row : row + 1, : len(x)], None, named)[0, 0]
        torch.testing.assert_close(padded[row], alone, rtol=0, atol=1e-10)


def test_a_whole_run_equals_the_in_process_flower_run(llama):
    """Same sampling, votes, clipping and noise: the same model (float32)."""
    task = TaskConfig(
        model=llama, local_mode="lora-top", lora_r=4, max_length=16, local_epochs=1,
        local_batch_size=4, lr=0.05, num_clients=6, examples_per_client=4, eval_examples=8,
    )  # fmt: skip
    cfg = ServerConfig(
        method="lac", num_clients=6, clients_per_round=3, rounds=2, target_epsilon=None,
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
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=3e-4)
    assert any(not np.allclose(a, s) for a, s in zip(batched.params, start, strict=True))

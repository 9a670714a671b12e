"""The batched engine equals the per-client path: every client's update, loss and vote
losses to 1e-6 in float64 (tiny random BERT, LoRA on the top layer, uneven client sizes so
some clients sit out a step), and a whole run equals the in-process Flower run."""

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
from dpfit.federated.batched_layers import BatchedEngineError
from dpfit.federated.client import (
    TaskConfig,
    evaluate,
    load_local_model,
)
from dpfit.federated.strategy import ServerConfig
from dpfit.models import save_tiny_random_model

TOL = 1e-6


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return str(save_tiny_random_model(tmp_path_factory.mktemp("bert"), arch="bert"))


def _task(bert: str, optimizer: str) -> TaskConfig:
    return TaskConfig(
        model=bert, local_mode="lora-top", lora_r=4, max_length=16, local_epochs=2,
        local_batch_size=3, lr=0.05, local_optimizer=optimizer,
    )  # fmt: skip


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_each_client_update_equals_the_per_client_path(bert, optimizer):
    lm = load_local_model(bert, "lora-top", 4, 0, "float64")
    assert_updates_match(lm, _task(bert, optimizer), TOL, no_gradient=("key.bias",))


def test_losses_votes_and_evaluation_equal_the_per_client_path(bert):
    lm = load_local_model(bert, "lora-top", 4, 0, "float64")
    assert_losses_votes_evaluation_match(lm, _task(bert, "adamw"), TOL)


def test_batched_engine_refuses_a_mode_with_trainables_below_the_top(bert):
    lm = load_local_model(bert, "lora", 4, 0)
    with pytest.raises(BatchedEngineError, match="lora-top or bias"):
        BatchedClients(lm, TaskConfig(model=bert, local_mode="lora"), lambda p: [])


@pytest.mark.parametrize("method", ["clac", "lac"])
def test_a_whole_run_equals_the_in_process_flower_run(bert, method):
    """Same sampling, votes, client losses, clipping and noise: the same model (float32)."""
    task = TaskConfig(
        model=bert, local_mode="lora-top", lora_r=4, max_length=16, local_epochs=1,
        local_batch_size=4, lr=0.05, num_clients=8, examples_per_client=5, eval_examples=8,
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


def test_cached_qkv_products_give_each_clients_own_model(bert):
    """The frozen x Wq^T, x Wk^T, x Wv^T are cached per text and shared by every client; each
    client's own q/k/v biases (different here, the key's included) and LoRA terms are added
    on top: its losses equal its own full model's, and the logits equal the uncached ones."""
    lm = load_local_model(bert, "lora-top", 4, 0, "float64")
    task = _task(bert, "sgd")
    data = random_clients([5, 4, 6], seed=5)
    engine = BatchedClients(lm, task, lambda p: data[p])
    engine.cache.fill([e.text for d in data for e in d])
    clients = [perturbed_start(lm, seed=10 + p) for p in range(len(data))]
    stacked = [torch.as_tensor(np.stack(arrs)) for arrs in zip(*clients, strict=True)]
    named = dict(zip(lm.trainable, stacked, strict=True))
    for part in ("query", "key", "value"):
        bias = next(v for n, v in named.items() if f"self.{part}." in n and n.endswith("bias"))
        assert not torch.equal(bias[0], bias[1]), f"the clients' {part} biases must differ"
    mine = engine.mean_losses(stacked, data)
    texts = [e.text for d in data for e in d]
    assert set(texts) <= set(engine.cache.projected)  # the cached path was the one taken
    for p, d in enumerate(data):
        lm.set_arrays(clients[p])
        ref = evaluate(lm, [e.text for e in d], [e.label for e in d], 16)[0]
        assert mine[p] == pytest.approx(ref, abs=TOL)
    text = data[0][0].text
    hidden = engine.cache.store[text][None, None].expand(len(data), 1, -1, -1)
    projected = engine.cache.projected[text][None, None].expand(len(data), 1, -1, -1)
    cached = engine.top.logits(hidden, None, named, projected)
    direct = engine.top.logits(hidden, None, named)
    torch.testing.assert_close(cached, direct, rtol=0, atol=1e-10)

"""The in-process app loses nothing: non-private FedAvg through Flower messages equals the
clients' own trainer run by hand (BiTFiT clients on a tiny random BERT, about a second)."""

from __future__ import annotations

import numpy as np
import pytest

from dpfit.federated.app import client_examples, initial_arrays, run_local
from dpfit.federated.client import TaskConfig, load_local_model, local_train
from dpfit.federated.strategy import ServerConfig
from dpfit.models import save_tiny_random_model


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return str(save_tiny_random_model(tmp_path_factory.mktemp("bert"), arch="bert"))


def _task(model: str, clients: int, epochs: int) -> TaskConfig:
    return TaskConfig(
        model=model, local_mode="bias", num_clients=clients, examples_per_client=6,
        eval_examples=4, max_length=16, local_batch_size=4, local_epochs=epochs, lr=0.05,
    )  # fmt: skip


def _fedavg(task: TaskConfig, rounds: int) -> list[np.ndarray]:
    """Non-private FedAvg: every client every round (q = 1), z = 0, no update clipped."""
    cfg = ServerConfig(
        method="fixed", num_clients=task.num_clients, clients_per_round=task.num_clients,
        rounds=rounds, target_epsilon=None, noise_multiplier=0.0, initial_clip=1e9,
        insecure_seed=0,
    )  # fmt: skip
    return run_local(cfg, task).params


def _by_hand(task: TaskConfig, rounds: int) -> list[np.ndarray]:
    """Each round: every client's local_train from the current model, with the generator a
    client derives (data seed, partition id, round; one draw spent on the fault-injection
    check); the model moves by the mean update."""
    lm = load_local_model(task.model, task.local_mode, task.lora_r, task.seed)
    params = initial_arrays(task)
    for r in range(1, rounds + 1):
        updates = []
        for pid in range(task.num_clients):
            ex = client_examples(task, pid)
            rng = np.random.default_rng([task.seed, pid, r])
            rng.random()  # the client's fail_probability draw
            u, _ = local_train(lm, params, [e.text for e in ex], [e.label for e in ex], task, rng)
            updates.append(u)
        mean = [np.mean(arrs, axis=0) for arrs in zip(*updates, strict=True)]
        params = [p + u for p, u in zip(params, mean, strict=True)]
    return params


@pytest.mark.parametrize(
    "clients,rounds,epochs",
    [(1, 2, 1), (3, 2, 2)],
    ids=["one-client-is-central-training", "three-clients-mean-update"],
)
def test_non_private_fedavg_equals_the_clients_trainer_by_hand(bert, clients, rounds, epochs):
    """With one client the federation is central training on its data (a fresh AdamW each
    round); with several, each round adds the plain mean of their updates. Every trainable
    tensor (biases of every layer and the head) must come back in place and in order."""
    task = _task(bert, clients, epochs)
    fed = _fedavg(task, rounds)
    ref = _by_hand(task, rounds)
    start = initial_arrays(task)
    lm = load_local_model(task.model, task.local_mode, task.lora_r, task.seed)
    assert len(fed) == len(ref) == len(lm.trainable)
    moved = 0
    for name, f, r, s in zip(lm.trainable, fed, ref, start, strict=True):
        np.testing.assert_allclose(f, r, rtol=1e-5, atol=1e-6, err_msg=name)
        moved += not np.allclose(f, s)
    assert moved > len(start) // 2  # the check compares trained tensors, not initial ones

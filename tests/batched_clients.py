"""Clients and start points shared by the batched engine's exactness tests (one per layer
family): uneven random clients of tiny-vocabulary texts, and a start away from the model's
initial values so every trainable gets a gradient at the first step."""

from __future__ import annotations

import numpy as np

from dpfit.data.bundled import TextExample
from dpfit.models import TINY_WORDS


def random_clients(sizes: list[int], seed: int = 0) -> list[list[TextExample]]:
    rng = np.random.default_rng(seed)
    out = []
    for c, n in enumerate(sizes):
        rows = []
        for i in range(n):
            words = rng.choice(TINY_WORDS, size=int(rng.integers(1, 10)))
            rows.append(TextExample(f"{c} {i} " + " ".join(words), int(rng.random() < 0.5)))
        out.append(rows)
    return out


def perturbed_start(lm, seed: int = 1) -> list[np.ndarray]:
    """The trainables' initial values plus N(0, 0.3^2): a non-zero head and LoRA B."""
    rng = np.random.default_rng(seed)
    return [a + 0.3 * rng.standard_normal(a.shape) for a in lm.initial]


def assert_updates_match(lm, task, tol: float, no_gradient: tuple[str, ...] = ()) -> None:
    """Every client's batched update equals ``local_train``'s, trainable by trainable, on
    uneven clients (2, 1, 2, 1 batches an epoch: clients sit steps out). ``no_gradient``:
    name endings that get none by construction (BERT's key bias: softmax ignores q.b_k)."""
    from dpfit.federated.batched import BatchedClients
    from dpfit.federated.client import local_train

    data = random_clients([4, 3, 5, 1])
    start = perturbed_start(lm)
    engine = BatchedClients(lm, task, lambda p: data[p])
    engine.cache.fill([e.text for d in data for e in d])
    got = engine.train(start, data, [np.random.default_rng([7, p]) for p in range(len(data))])
    for p, d in enumerate(data):
        ref, _ = local_train(
            lm, start, [e.text for e in d], [e.label for e in d], task,
            np.random.default_rng([7, p]),
        )  # fmt: skip
        assert len(got[p]) == len(ref) == len(lm.trainable)
        for name, g, r in zip(lm.trainable, got[p], ref, strict=True):
            if not (no_gradient and name.endswith(no_gradient)):
                assert np.abs(r).max() > 0, f"{name} did not train: the check would be empty"
            np.testing.assert_allclose(g, r, rtol=0, atol=tol, err_msg=f"client {p} {name}")


def assert_losses_votes_evaluation_match(lm, task, tol: float, apart: bool = False) -> None:
    """The batched clients' mean losses, vote losses and the server's evaluation equal the
    per-client path's. ``apart``: each client's losses at its own point (else all at one)."""
    import pytest
    import torch

    from dpfit.federated.batched import BatchedClients
    from dpfit.federated.client import candidate_losses, evaluate, local_train

    data = random_clients([4, 6, 2], seed=3)
    start = perturbed_start(lm, seed=2)
    engine = BatchedClients(lm, task, lambda p: data[p])
    engine.cache.fill([e.text for d in data for e in d])
    points = [perturbed_start(lm, seed=10 + p) if apart else start for p in range(len(data))]
    stacked = [torch.as_tensor(np.stack(arrs)) for arrs in zip(*points, strict=True)]
    mine = engine.mean_losses(stacked, data)
    cands = [0.05, 0.2, 1.0]
    votes = engine.candidate_losses(start, [0, 1, 2], cands, 1.5, 3.0)
    length = task.max_length
    for p, d in enumerate(data):
        texts, labels = [e.text for e in d], [e.label for e in d]
        lm.set_arrays(points[p])
        assert mine[p] == pytest.approx(evaluate(lm, texts, labels, length)[0], abs=tol)
        rng = np.random.default_rng([task.seed, p, 0])
        update, _ = local_train(lm, start, texts, labels, task, rng)
        ref = candidate_losses(lm, start, update, texts, labels, cands, 1.5, 3.0, length, rng)
        np.testing.assert_allclose(votes[p], ref, rtol=0, atol=tol)
    texts = [e.text for d in data for e in d]
    labels = [e.label for d in data for e in d]
    loss, acc = engine.evaluate_fn(texts, labels)(start)
    lm.set_arrays(start)
    ref_loss, ref_acc = evaluate(lm, texts, labels, length)
    assert loss == pytest.approx(ref_loss, abs=tol) and acc == ref_acc

"""Federated clients that fine-tune the model: LoRA on a LLaMA (SmolLM2's architecture) and
BiTFiT on a BERT (MiniLM's), with tiny random models so each test takes about a second."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpfit.federated.client import (
    ClientTaskError,
    TaskConfig,
    backward_batch,
    candidate_losses,
    evaluate,
    load_local_model,
    local_train,
)
from dpfit.federated.clipping import clip_update, one_hot_vote
from dpfit.federated.strategy import ClientReply, DPFedAvgServer, ServerConfig
from dpfit.models import TINY_WORDS, save_tiny_random_model

LAYERS, WIDTH, RANK = 2, 16, 4  # save_tiny_random_model's sizes; the LoRA rank we ask for


def _texts(n: int, seed: int = 0) -> tuple[list[str], list[int]]:
    rng = np.random.default_rng(seed)
    pos, neg = ("good", "great", "superb", "fun"), ("bad", "awful", "dull", "boring")
    texts, labels = [], []
    for _ in range(n):
        y = int(rng.random() < 0.5)
        words = list(rng.choice(TINY_WORDS, size=int(rng.integers(1, 9))))
        words.insert(int(rng.integers(0, len(words) + 1)), str(rng.choice(pos if y else neg)))
        texts.append(" ".join(words))
        labels.append(y)
    return texts, labels


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return str(save_tiny_random_model(tmp_path_factory.mktemp("llama"), arch="llama"))


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return str(save_tiny_random_model(tmp_path_factory.mktemp("bert"), arch="bert"))


def _task(model: str, mode: str, **kw) -> TaskConfig:
    base = dict(model=model, local_mode=mode, lora_r=RANK, local_batch_size=4, lr=0.05)
    base.update(kw)
    return TaskConfig(**base)


def _train(lm, task, texts, labels, seed=0):
    return local_train(lm, lm.initial, texts, labels, task, np.random.default_rng(seed))


def _frozen_state(lm) -> dict[str, torch.Tensor]:
    train = set(lm.trainable)
    return {n: p.detach().clone() for n, p in lm.model.named_parameters() if n not in train}


def test_lora_trainable_set_is_the_adapters_on_q_v_and_the_head(llama):
    lm = load_local_model(llama, "lora", RANK, 0)
    expected = {"head.weight", "head.bias"}
    for layer in range(LAYERS):
        for proj in ("q_proj", "v_proj"):
            for ab in ("lora_A", "lora_B"):
                expected.add(f"backbone.layers.{layer}.self_attn.{proj}.{ab}.default.weight")
    assert set(lm.trainable) == expected
    assert lm.trainable == [n for n, p in lm.model.named_parameters() if p.requires_grad]


def test_lora_round_changes_only_adapters_and_head(llama):
    lm = load_local_model(llama, "lora", RANK, 0)
    texts, labels = _texts(16)
    frozen = _frozen_state(lm)
    update, loss = _train(lm, _task(llama, "lora"), texts, labels)
    assert np.isfinite(loss)
    named = dict(zip(lm.trainable, update, strict=True))
    # several steps: the zero head moves first, then both LoRA factors
    for name, u in named.items():
        assert np.abs(u).max() > 0, f"{name} did not train"
    # the frozen weights are exactly as loaded, and the live model is back at the start
    for n, p in lm.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n
    for a, b in zip(lm.get_arrays(), lm.initial, strict=True):
        np.testing.assert_array_equal(a, b)


def test_lora_update_shape_matches_the_trainable_set(llama):
    lm = load_local_model(llama, "lora", RANK, 0)
    texts, labels = _texts(8)
    update, _ = _train(lm, _task(llama, "lora"), texts, labels)
    named = lm.parameters_by_name()
    assert [u.shape for u in update] == [tuple(named[n].shape) for n in lm.trainable]
    # r x d_in (A) + d_out x r (B) on q and v in every layer, plus a 2-class linear head;
    # the tiny LLaMA has as many key/value heads as query heads, so d_out = WIDTH for v too
    adapters = LAYERS * 2 * (RANK * WIDTH + WIDTH * RANK)
    assert sum(u.size for u in update) == adapters + 2 * WIDTH + 2


def test_server_clips_a_lora_update_to_c(llama):
    lm = load_local_model(llama, "lora", RANK, 0)
    texts, labels = _texts(16)
    update, _ = _train(lm, _task(llama, "lora", lr=0.5), texts, labels)
    norm = float(np.sqrt(sum(float((u.astype(np.float64) ** 2).sum()) for u in update)))
    clip = norm / 4  # the clip is active
    cfg = ServerConfig(
        method="fixed",
        num_clients=2,
        clients_per_round=2,
        rounds=1,
        noise_multiplier=0.0,
        initial_clip=clip,
    )
    server = DPFedAvgServer(cfg, lm.initial)
    server.aggregate([7], [ClientReply(7, update=update)])
    step = [p - np.asarray(a) for p, a in zip(server.params, lm.initial, strict=True)]
    contributed = [2 * s for s in step]  # the sum of clipped updates, divided by m = 2
    step_norm = float(np.sqrt(sum(float((c.astype(np.float64) ** 2).sum()) for c in contributed)))
    assert step_norm <= clip * (1 + 1e-5)
    assert step_norm == pytest.approx(clip, rel=1e-4)
    for c, u in zip(contributed, update, strict=True):  # same direction, scaled by C/||u||
        np.testing.assert_allclose(c, u * (clip / norm), rtol=1e-3, atol=1e-7)


def test_lac_vote_with_lora_updates(llama):
    lm = load_local_model(llama, "lora", RANK, 0)
    texts, labels = _texts(16)
    task = _task(llama, "lora", lr=0.5)
    update, _ = _train(lm, task, texts, labels)
    norm = float(np.sqrt(sum(float((u**2).sum()) for u in update)))
    candidates = [norm / 100, norm / 3, norm]
    losses = candidate_losses(
        lm, lm.initial, update, texts, labels, candidates, 0.0, 4.0, task.max_length,
        np.random.default_rng(0),
    )  # fmt: skip
    # without noise, each candidate's loss is the loss at start + clip(update, c)
    for c, got in zip(candidates, losses, strict=True):
        clipped, _ = clip_update(update, c)
        lm.set_arrays([a + u for a, u in zip(lm.initial, clipped, strict=True)])
        assert got == pytest.approx(evaluate(lm, texts, labels, task.max_length)[0], rel=1e-5)
    lm.set_arrays(lm.initial)
    assert len(set(np.round(losses, 6))) == 3  # the candidates lead to different models
    vote = one_hot_vote(losses)
    assert sum(vote) == 1 and vote[int(np.argmin(losses))] == 1
    # noised trials (z = 1, m = 4) stay finite, and the model is left at the start
    noisy = candidate_losses(
        lm, lm.initial, update, texts, labels, candidates, 1.0, 4.0, task.max_length,
        np.random.default_rng(1),
    )  # fmt: skip
    assert all(np.isfinite(noisy))
    for a, b in zip(lm.get_arrays(), lm.initial, strict=True):
        np.testing.assert_array_equal(a, b)


def test_length_chunks_give_the_gradient_of_one_padded_batch(llama):
    lm = load_local_model(llama, "lora", RANK, 0)
    texts, labels = _texts(12, seed=3)
    y = torch.as_tensor(labels)
    idx = np.arange(len(texts))
    rng = np.random.default_rng(0)
    # a nonzero head and B so that every trainable tensor gets a gradient
    lm.set_arrays([rng.normal(0, 0.3, a.shape).astype(a.dtype) for a in lm.initial])
    params = [lm.parameters_by_name()[n] for n in lm.trainable]
    for p in params:
        p.grad = None
    ids = lm.encode(texts, 48)
    assert len({len(x) for x in ids}) > 2  # texts of several lengths: chunks do differ
    mean = backward_batch(lm, texts, ids, y, idx, 48)
    chunked = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    batch = lm.tokenizer(texts, padding=True, return_tensors="pt")  # one padded forward
    loss = torch.nn.functional.cross_entropy(lm.model(**batch).logits, y)
    loss.backward()
    assert mean == pytest.approx(loss.item(), rel=1e-5)
    for p, g in zip(params, chunked, strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7)
    lm.set_arrays(lm.initial)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return str(save_tiny_random_model(tmp_path_factory.mktemp("gpt2"), arch="gpt2"))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # rotary and absolute positions
def test_last_token_head_reads_the_same_logits_with_left_or_right_padding(arch, request):
    lm = load_local_model(request.getfixturevalue(arch), "lora", RANK, 0)
    texts, labels = _texts(6, seed=5)
    rng = np.random.default_rng(0)
    lm.set_arrays([rng.normal(0, 0.3, a.shape).astype(a.dtype) for a in lm.initial])
    ids = lm.encode(texts, 48)
    alone = torch.cat([lm.model(**lm.batch([x])).logits for x in ids])
    side = lm.tokenizer.padding_side
    try:
        for padding in ("right", "left"):
            lm.tokenizer.padding_side = padding
            with torch.no_grad():
                padded = lm.model(**lm.batch(ids)).logits
            torch.testing.assert_close(padded, alone, rtol=1e-4, atol=1e-5)
    finally:
        lm.tokenizer.padding_side = side
        lm.set_arrays(lm.initial)


def test_bitfit_round_on_an_encoder_trains_biases_and_head_only(bert):
    lm = load_local_model(bert, "bias", RANK, 0)
    assert lm.trainable and all(n.endswith(".bias") or n.startswith("head.") for n in lm.trainable)
    assert any(not n.startswith("head.") for n in lm.trainable)
    texts, labels = _texts(16)
    frozen = _frozen_state(lm)
    update, _ = _train(lm, _task(bert, "bias"), texts, labels)
    assert sum(np.abs(u).max() > 0 for u in update) > len(update) // 2
    for n, p in lm.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


def test_bias_mode_on_a_model_without_biases_is_a_clear_error(llama):
    with pytest.raises(ClientTaskError, match="local-mode lora"):
        load_local_model(llama, "bias", RANK, 0)


def test_lora_clients_run_dp_lac_end_to_end(llama):
    """Vote, rounds and the server's checks through Flower messages, on LoRA clients."""
    from dpfit.federated.app import run_local

    task = TaskConfig(
        model=llama, local_mode="lora", lora_r=RANK, num_clients=4, examples_per_client=8,
        eval_examples=16, max_length=16, local_batch_size=4,
    )  # fmt: skip
    cfg = ServerConfig(
        method="lac", num_clients=4, clients_per_round=2, rounds=2, target_epsilon=8.0,
        insecure_seed=0,
    )  # fmt: skip
    server = run_local(cfg, task)
    assert server.round == 2 and len(server.vote_counts) == 3
    lm = load_local_model(llama, "lora", RANK, 0)
    assert [p.shape for p in server.params] == [a.shape for a in lm.initial]
    assert any(not np.array_equal(p, a) for p, a in zip(server.params, lm.initial, strict=True))


class _RecordingGrid:
    """Wraps the in-process grid and keeps every (message type, reply content) pair."""

    def __init__(self, inner):
        self.inner = inner
        self.seen: list[tuple[str, object]] = []

    def get_node_ids(self):
        return self.inner.get_node_ids()

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        replies = self.inner.send_and_receive(messages, timeout=timeout)
        kind = messages[0].metadata.message_type if messages else ""
        self.seen += [(kind, r.content) for r in replies if not r.has_error()]
        return replies


@pytest.mark.parametrize("method", ["lac", "clac"])
def test_client_replies_carry_only_what_the_private_releases_use(llama, method):
    """Client -> server: the vote reply is the one-hot vote alone; a training reply is the
    update plus, for DP-CLAC only, the loss clamped to [0, L_max]. Any other data-dependent
    value (candidate or training losses, example counts) would travel unaccounted."""
    from dpfit.federated.app import LocalGrid, run_local
    from dpfit.federated.client import build_client_app

    task = TaskConfig(
        model=llama, local_mode="lora", lora_r=RANK, num_clients=3, examples_per_client=6,
        eval_examples=8, max_length=12, local_batch_size=3,
    )  # fmt: skip
    cfg = ServerConfig(
        method=method, num_clients=3, clients_per_round=3, rounds=2, target_epsilon=8.0,
        insecure_seed=0, loss_bound=0.25,  # below a 2-class loss near ln 2: clamping shows
    )  # fmt: skip
    grid = _RecordingGrid(LocalGrid.for_app(build_client_app(), task.num_clients))
    server = run_local(cfg, task, grid=grid)
    assert server.round == 2
    kinds = [k for k, _ in grid.seen]
    assert kinds.count("train") == 6
    assert kinds.count("query") == 3  # DP-LAC and DP-CLAC both start from the vote
    for kind, content in grid.seen:
        if kind == "query":
            assert list(content.keys()) == ["vote"]
            assert list(content["vote"].keys()) == ["vote"]
            vote = list(content["vote"]["vote"])
            assert len(vote) == len(cfg.vote_factors) and sorted(vote) == [0, 0, 1]
        else:
            assert sorted(content.keys()) == ["metrics", "update"]
            metrics = dict(content["metrics"])
            if method == "clac":
                assert list(metrics) == ["loss_before"]
                assert 0.0 <= metrics["loss_before"] <= cfg.loss_bound
            else:
                assert metrics == {}


def test_on_epoch_sees_the_parameters_a_shorter_run_ends_with(bert):
    """One run scored at several epoch counts = separate runs of those lengths."""
    lm = load_local_model(bert, "bias", RANK, 0)
    texts, labels = _texts(12)
    seen = {}
    long = _task(bert, "bias", local_epochs=3)
    local_train(
        lm, lm.initial, texts, labels, long, np.random.default_rng(5),
        lambda k, p: seen.__setitem__(k, p),
    )  # fmt: skip
    assert sorted(seen) == [1, 2, 3]
    for k in (1, 2):
        u, _ = _train(lm, _task(bert, "bias", local_epochs=k), texts, labels, seed=5)
        for a, s, b in zip(seen[k], lm.initial, u, strict=True):
            np.testing.assert_allclose(a, s + b, rtol=1e-5, atol=1e-6)

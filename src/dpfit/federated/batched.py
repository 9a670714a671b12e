"""Batched client simulation: a round's sampled clients trained as one computation.

The per-client path (``client.local_train`` behind Flower) runs the whole model once per
client and step. Here the part of the model that no client trains runs once per example and
is cached (``FrozenCache``); the part that trains runs for all of a round's clients at once,
each client's trainables stacked on a leading client axis and the frozen weights shared. What
is frozen and what trains depends on the model and local mode; each combination is a layer
family in ``batched_layers`` (``lora-top`` on a BERT encoder or a LLaMA-style decoder: the
layers below the top one are frozen; ``bias`` on a BERT encoder: only the embeddings' sum is
frozen, every layer runs per client). The loss is the sum over clients of each client's
batch-mean loss, so one backward gives every client its own gradient, and the optimizer
(AdamW or SGD written as element-wise updates with a per-client step count) steps each client
as its own optimizer would. Each client's data order comes from the same generator as on the
per-client path, so the updates are the per-client path's (checked to 1e-6 in float64 by the
tests of each family).

Where the first trained layer's query/key/value weights are frozen and read the cached input
(BERT ``lora-top``), their products with each text are cached too (``FrozenCache.project``).
Examples are grouped by exact length (``length_buckets``), so nothing is padded, and a
training step's backward runs chunk by chunk (the gradients add up) so only one chunk's graph
is held.

``run_batched`` drives the SAME server core as Flower (``DPFedAvgServer``: Poisson sampling,
reply validation, clip rules, one noise draw, accountant, checkpoints), so only the transport
differs: replies are built in-process instead of crossing a Grid.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from dpfit import progress
from dpfit.data.bundled import TextExample
from dpfit.federated.batched_layers import (
    TrainedTop,
    trained_top,
)
from dpfit.federated.client import (
    LocalModel,
    _batches,
    clamp_loss,
    initial_arrays,
    task_model,
)
from dpfit.federated.clipping import clip_rule_class, clip_update
from dpfit.federated.examples import client_examples, eval_split
from dpfit.federated.public_trial import TrialFn, make_trial_fn, pseudo_rngs
from dpfit.federated.server_config import ServerConfig
from dpfit.federated.strategy import ClientReply, DPFedAvgServer, RoundRecord
from dpfit.federated.task_config import TaskConfig

logger = logging.getLogger(__name__)

NODE_OFFSET = 1000  # node ids as LocalGrid.for_app numbers them: the same Poisson draws
CLIENT_CHUNK = 100  # clients per computation (memory bound; results do not depend on it)
EVAL_CHUNK = 128
FLAT_CHUNK = 256  # (client, example) pairs per top-layer computation
PROJECT_CHUNK = 512  # texts per frozen q/k/v product
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
FEATURES_STAGE = "frozen features"  # progress stage of FrozenCache.fill


class FrozenCache:
    """Input of the first trained layer for each text (the family's ``frozen_hidden``): the
    frozen part of the model, run once.

    Keyed by text; each entry is the unpadded (length, width) hidden states. Computed in
    length-sorted chunks with the attention mask, so padding does not change a real token's
    states. ``projected`` keeps, per text, the first trained layer's frozen query, key and
    value products (x Wq^T, x Wk^T, x Wv^T, no bias) where the family has them (BERT
    ``lora-top``): every client and every evaluation shares them, only the biases and LoRA
    terms differ by client (they take three times the memory of the hidden states).
    """

    def __init__(self, lm: LocalModel, top: TrainedTop, max_length: int) -> None:
        self.lm, self.top = lm, top
        self.max_length = max_length
        self.store: dict[str, torch.Tensor] = {}
        self.projected: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def fill(self, texts: Sequence[str]) -> None:
        missing = sorted({t for t in texts if t not in self.store})
        if not missing:
            return
        lm = self.lm
        ids = lm.encode(missing, self.max_length)
        order = np.argsort([len(x) for x in ids], kind="stable")
        for i in range(0, len(order), EVAL_CHUNK):
            progress.report(FEATURES_STAGE, i, len(order))
            idx = order[i : i + EVAL_CHUNK]
            out = self.top.frozen_hidden(lm.batch([ids[j] for j in idx]))
            for row, j in enumerate(idx):
                n = len(ids[j])
                self.store[missing[j]] = out[row, :n].clone()
        progress.report(FEATURES_STAGE, len(order), len(order))

    @torch.no_grad()
    def project(self, texts: Sequence[str], weight: torch.Tensor) -> None:
        """Cache x W^T for these texts (``weight``: the frozen q, k, v weights stacked)."""
        missing = [t for t in dict.fromkeys(texts) if t not in self.projected]
        for i in range(0, len(missing), PROJECT_CHUNK):
            part = missing[i : i + PROJECT_CHUNK]
            rows = [self.store[t] for t in part]
            out = torch.cat(rows) @ weight.transpose(0, 1)
            for t, y in zip(part, torch.split(out, [len(r) for r in rows]), strict=True):
                self.projected[t] = y

    def stacked(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Texts of ONE length -> hidden (N, L, H) and, if cached, their projections
        (N, L, 3H): no padding, so no mask."""
        hidden = torch.stack([self.store[t] for t in texts])
        if not all(t in self.projected for t in texts):
            return hidden, None
        return hidden, torch.stack([self.projected[t] for t in texts])


def length_buckets(lengths: Sequence[int], cap: int) -> list[np.ndarray]:
    """Indices grouped by exact length (at most ``cap`` each), shortest first: every group
    is computed without padding."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    out: list[np.ndarray] = []
    start = 0
    for i in range(1, len(order) + 1):
        if i == len(order) or lengths[order[i]] != lengths[order[start]] or i - start == cap:
            out.append(order[start:i])
            start = i
    return out


class _StackedOptimizer:
    """AdamW (weight decay 0) or SGD on stacked client tensors, one step count per client.

    The update is element-wise, so stepping the stack equals stepping each client's own
    ``torch.optim`` optimizer; clients without a batch in a step are left untouched.
    """

    def __init__(self, name: str, params: list[torch.Tensor], lr: float) -> None:
        self.name, self.params, self.lr = name, params, lr
        k = params[0].shape[0]
        self.steps = torch.zeros(k, dtype=torch.long)
        if name == "adamw":
            self.m = [torch.zeros_like(p) for p in params]
            self.v = [torch.zeros_like(p) for p in params]

    @torch.no_grad()
    def step(self, active: torch.Tensor) -> None:
        self.steps += active.long()
        for i, p in enumerate(self.params):
            g = p.grad
            shape = (-1,) + (1,) * (p.dim() - 1)
            act = active.reshape(shape)
            if self.name == "sgd":
                p.sub_(torch.where(act, self.lr * g, torch.zeros_like(g)))
                continue
            b1, b2 = ADAM_BETAS
            m = torch.where(act, self.m[i].lerp(g, 1 - b1), self.m[i])
            v = torch.where(act, self.v[i] * b2 + (1 - b2) * g * g, self.v[i])
            self.m[i], self.v[i] = m, v
            t = self.steps.clamp(min=1).to(p.dtype).reshape(shape)
            step_size = self.lr / (1 - b1**t)
            denom = v.sqrt() / (1 - b2**t).sqrt() + ADAM_EPS
            p.sub_(torch.where(act, step_size * m / denom, torch.zeros_like(p)))


ClientData = Callable[[int], Sequence[TextExample]]


class BatchedClients:
    """Local training, client losses and votes for many clients at once (any local mode
    with a layer family in ``batched_layers``)."""

    def __init__(self, lm: LocalModel, task: TaskConfig, client_data: ClientData) -> None:
        self.lm, self.task, self.client_data = lm, task, client_data
        self.top = trained_top(lm)
        self.cache = FrozenCache(lm, self.top, task.max_length)
        self.dtype = next(lm.model.parameters()).dtype

    # -- parameters ---------------------------------------------------------------------

    def _stack(self, arrays: Sequence[np.ndarray], k: int) -> list[torch.Tensor]:
        return [
            torch.as_tensor(np.asarray(a), dtype=self.dtype)
            .unsqueeze(0)
            .repeat(k, *([1] * np.ndim(a)))
            for a in arrays
        ]

    def _params(self, stacked: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(zip(self.top.trainable, stacked, strict=True))

    # -- forward pieces -----------------------------------------------------------------

    def _project(self, texts: Sequence[str]) -> None:
        """Cache the frozen q/k/v products of these texts (no-op if a q/k/v weight trains)."""
        if self.top.qkv_weight is not None:
            self.cache.project(texts, self.top.qkv_weight.to(self.dtype))

    def _chunk_losses(
        self,
        stacked: Sequence[torch.Tensor],
        rows: list[list[tuple[str, int] | None]],
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(client index, cross-entropy) of each (client, example) pair, chunk by chunk.

        All pairs are flattened and grouped by exact length (``length_buckets``: no padding,
        so no mask); each example reads its own client's parameters (gathered by client
        index), so clients still train apart.
        """
        flat = [
            (k, t, y) for k, row in enumerate(rows) for s in row if s is not None for t, y in [s]
        ]
        if not flat:
            return
        self._project([t for _, t, _ in flat])
        params = self._params(stacked)
        lengths = [len(self.cache.store[t]) for _, t, _ in flat]
        for part in length_buckets(lengths, FLAT_CHUNK):
            items = [flat[i] for i in part]
            hidden, projected = self.cache.stacked([t for _, t, _ in items])
            if projected is not None:
                projected = projected.unsqueeze(1)
            kidx = torch.as_tensor([k for k, _, _ in items])
            per_example = {n: v.index_select(0, kidx) for n, v in params.items()}
            logits = self.top.logits(hidden.unsqueeze(1), None, per_example, projected)[:, 0]
            labels = torch.as_tensor([y for _, _, y in items])
            yield kidx, F.cross_entropy(logits, labels, reduction="none")

    def _losses(
        self,
        stacked: Sequence[torch.Tensor],
        rows: list[list[tuple[str, int] | None]],
    ) -> torch.Tensor:
        """Each client's SUM of cross-entropies over its row (K,); empty slots add nothing."""
        total = torch.zeros(len(rows), dtype=stacked[0].dtype)
        for kidx, ce in self._chunk_losses(stacked, rows):
            total = total.index_add(0, kidx, ce)
        return total

    @torch.no_grad()
    def mean_losses(
        self, stacked: Sequence[torch.Tensor], data: list[Sequence[TextExample]]
    ) -> list[float]:
        """Each client's mean cross-entropy on its own data (per-client ``evaluate``)."""
        rows = [[(e.text, e.label) for e in d] for d in data]
        width = max(len(r) for r in rows)
        rows = [r + [None] * (width - len(r)) for r in rows]
        total = self._losses(stacked, rows)
        return [float(t) / max(1, len(d)) for t, d in zip(total, data, strict=True)]

    # -- local training -----------------------------------------------------------------

    def train(
        self,
        start: Sequence[np.ndarray],
        data: list[Sequence[TextExample]],
        rngs: list[np.random.Generator],
        on_step: Callable[[int, int], None] | None = None,
    ) -> list[list[np.ndarray]]:
        """Each client's update (new - start), as ``client.local_train`` would return it.

        ``on_step(done, total)``: after each local step (progress only; ``total`` is known once
        the last epoch's plan is drawn, an estimate before)."""
        task, k = self.task, len(data)
        stacked = [t.requires_grad_(True) for t in self._stack(start, k)]
        opt = _StackedOptimizer(task.local_optimizer, stacked, task.lr)
        steps_done = 0
        for _ in range(task.local_epochs):
            plans = [
                _batches(len(d), task.local_batch_size, r) for d, r in zip(data, rngs, strict=True)
            ]
            epoch_steps = max(len(p) for p in plans)
            for s in range(epoch_steps):
                rows: list[list[tuple[str, int] | None]] = []
                sizes = []
                for d, p in zip(data, plans, strict=True):
                    idx = p[s] if s < len(p) else np.zeros(0, dtype=int)
                    rows.append([(d[i].text, d[i].label) for i in idx])
                    sizes.append(len(idx))
                width = max(sizes)
                rows = [r + [None] * (width - len(r)) for r in rows]
                active = torch.tensor([n > 0 for n in sizes])
                denom = torch.tensor([max(n, 1) for n in sizes], dtype=self.dtype)
                for t in stacked:
                    t.grad = None
                # the sum over clients of each one's batch-mean loss, backward chunk by chunk
                # (gradients add up): only one chunk's graph is held at a time
                for kidx, ce in self._chunk_losses(stacked, rows):
                    (ce / denom.index_select(0, kidx)).sum().backward()
                opt.step(active)
                steps_done += 1
                if on_step is not None:
                    on_step(steps_done, epoch_steps * task.local_epochs)
        out = []
        for i in range(k):
            out.append(
                [
                    (t[i].detach() - torch.as_tensor(np.asarray(a), dtype=self.dtype))
                    .cpu()
                    .numpy()
                    .astype(np.asarray(a).dtype)
                    for t, a in zip(stacked, start, strict=True)
                ]
            )
        return out

    def train_public(
        self, start: Sequence[np.ndarray], data: list[list[TextExample]]
    ) -> list[list[np.ndarray]]:
        """Pseudo-clients of the server's public trial, trained as clients are."""
        self.cache.fill([e.text for d in data for e in d])
        return self.train(start, data, pseudo_rngs(self.task.seed, len(data)))

    def _data(self, pids: Sequence[int]) -> list[Sequence[TextExample]]:
        data = [self.client_data(p) for p in pids]
        self.cache.fill([e.text for d in data for e in d])
        return data

    def round_replies(
        self,
        start: Sequence[np.ndarray],
        pids: Sequence[int],
        server_round: int,
        report_loss: bool = False,
        loss_bound: float = 0.0,
    ) -> list[ClientReply]:
        """The replies the sampled clients' ClientApp would send in ``server_round``."""
        replies: list[ClientReply] = []
        for c in range(0, len(pids), CLIENT_CHUNK):
            chunk = list(pids[c : c + CLIENT_CHUNK])
            data = self._data(chunk)
            rngs = [np.random.default_rng([self.task.seed, p, server_round]) for p in chunk]
            metrics: list[dict] = [{} for _ in chunk]
            if report_loss:
                before = self.mean_losses(self._stack(start, len(chunk)), data)
                for m, x in zip(metrics, before, strict=True):
                    m["loss_before"] = clamp_loss(x, loss_bound)
            for r in rngs:  # the ClientApp's failure-injection draw, to keep the data order
                r.random()
            updates = self.train(start, data, rngs)
            for p, u, m in zip(chunk, updates, metrics, strict=True):
                replies.append(ClientReply(NODE_OFFSET + p, update=u, metrics=m))
        return replies

    def candidate_losses(
        self,
        start: Sequence[np.ndarray],
        pids: Sequence[int],
        candidates: Sequence[float],
        noise_multiplier: float,
        expected_clients: float,
    ) -> np.ndarray:
        """(clients, candidates) local losses after one simulated noisy aggregate per
        candidate, drawn as ``client.candidate_losses`` draws them (the vote query).

        Progress: the "clip vote" stage in clients, moved on within each chunk of clients by
        its local steps and its candidates' evaluations (a chunk can take a minute)."""
        out = []
        work = len(candidates) + 1  # a chunk's training counts as one share, each candidate one
        for c in range(0, len(pids), CLIENT_CHUNK):
            chunk = list(pids[c : c + CLIENT_CHUNK])

            def moved(share: float, c: int = c, size: int = len(chunk)) -> None:
                progress.report("clip vote", c + int(size * share), len(pids))

            data = self._data(chunk)
            rngs = [np.random.default_rng([self.task.seed, p, 0]) for p in chunk]
            updates = self.train(
                start, data, rngs, on_step=lambda i, n, moved=moved: moved(i / n / work)
            )
            trials: list[list[list[np.ndarray]]] = [[] for _ in candidates]
            for u, rng in zip(updates, rngs, strict=True):
                for j, cand in enumerate(candidates):
                    clipped, _ = clip_update(u, cand)
                    std = noise_multiplier * cand / expected_clients
                    trials[j].append(
                        [
                            np.asarray(s)
                            + cu
                            + (rng.normal(0.0, std, size=cu.shape).astype(cu.dtype) if std else 0)
                            for s, cu in zip(start, clipped, strict=True)
                        ]
                    )
            cols = []
            for j in range(len(candidates)):
                stacked = [
                    torch.as_tensor(np.stack([t[i] for t in trials[j]]), dtype=self.dtype)
                    for i in range(len(start))
                ]
                cols.append(self.mean_losses(stacked, data))
                moved((j + 2) / work)
            out.append(np.asarray(cols).T)
        return np.concatenate(out, axis=0)

    # -- server-side evaluation ---------------------------------------------------------

    def evaluate_fn(
        self, texts: Sequence[str], labels: Sequence[int]
    ) -> Callable[[Sequence[np.ndarray]], tuple[float, float]]:
        """(loss, accuracy) on a fixed split through the cache: the full model's results."""
        self.cache.fill(texts)
        self._project(texts)
        y = torch.as_tensor(list(labels))
        chunks = length_buckets([len(self.cache.store[t]) for t in texts], EVAL_CHUNK)

        @torch.no_grad()
        def fn(params: Sequence[np.ndarray]) -> tuple[float, float]:
            if not texts:
                return math.nan, math.nan
            named = self._params(self._stack(params, 1))
            loss_sum, correct = 0.0, 0
            for idx in chunks:  # one length each: no padding
                hidden, projected = self.cache.stacked([texts[i] for i in idx])
                if projected is not None:
                    projected = projected.unsqueeze(0)
                logits = self.top.logits(hidden.unsqueeze(0), None, named, projected)[0]
                yy = y[torch.as_tensor(idx)]
                loss_sum += float(F.cross_entropy(logits, yy, reduction="sum"))
                correct += int((logits.argmax(-1) == yy).sum())
            return loss_sum / len(texts), correct / len(texts)

        return fn


def public_trial(
    engine: BatchedClients, method: str, texts: Sequence[str], labels: Sequence[int]
) -> TrialFn | None:
    """The server's trial on its public (texts, labels) if the rule asks for one."""
    if not clip_rule_class(method).needs_public_trial:
        return None
    return make_trial_fn(engine.train_public, engine.evaluate_fn, texts, labels, engine.task.seed)


def run_batched(
    server_cfg: ServerConfig,
    task: TaskConfig,
    on_round: Callable[[RoundRecord], None] | None = None,
    client_data: ClientData | None = None,
    eval_data: tuple[Sequence[str], Sequence[int]] | None = None,
    prefill: bool = True,
) -> DPFedAvgServer:
    """A run with the batched engine, through the same server core as the Flower engines.

    ``prefill``: cache every client's examples before the first round (the simulation holds
    all clients' data anyway); otherwise a client's are cached when it is first sampled.
    """
    from dpfit.federated.data import federation

    if task.data and client_data is None:
        federation(task)  # the user's data: every data error (and the label gate) up front
    lm = task_model(task)
    engine = BatchedClients(lm, task, client_data or (lambda p: client_examples(task, p)))
    texts, labels = eval_data if eval_data is not None else eval_split(task, "validation")
    trial = public_trial(engine, server_cfg.method, texts, labels)
    server = DPFedAvgServer(
        server_cfg, initial_arrays(task), engine.evaluate_fn(texts, labels), trial
    )
    if prefill:  # every client's frozen-layer output up front: later rounds are steady
        engine._data(range(task.num_clients))
    return drive(server, engine, task.num_clients, on_round)


def drive(
    server: DPFedAvgServer,
    engine: BatchedClients,
    num_clients: int,
    on_round: Callable[[RoundRecord], None] | None = None,
) -> DPFedAvgServer:
    """Vote (if the rule asks), then rounds until done or out of budget: ``DPFedAvg.start``
    with in-process replies."""

    cfg = server.config
    if cfg.checkpoint_dir:
        server.load_checkpoint(cfg.checkpoint_dir)
    pids = list(range(num_clients))
    if not server.initialised:
        votes = None
        if type(server.rule).needs_votes:
            q = server.vote_query_config()
            progress.report("clip vote", 0, num_clients)
            losses = engine.candidate_losses(
                server.params,
                pids,
                q["candidates"],
                q["noise_multiplier"],
                q["expected_clients"],
            )
            from dpfit.federated.clipping import one_hot_vote

            votes = [one_hot_vote(row.tolist()) for row in losses]
            progress.report("clip vote", num_clients, num_clients)
        server.initialise(votes)
    rule = type(server.rule)
    while server.round < cfg.rounds and server.can_run_another_round():
        sampled = server.sample_clients([NODE_OFFSET + p for p in pids])
        replies = engine.round_replies(
            server.params,
            [n - NODE_OFFSET for n in sampled],
            server.round + 1,
            report_loss=rule.needs_client_loss,
            loss_bound=float(server.rule.config.loss_bound),
        )
        record = server.aggregate(sampled, replies)
        if on_round is not None:
            on_round(record)
    return server

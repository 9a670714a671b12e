"""Flower ClientApp: local fine-tuning of a sequence classifier, and clip-candidate votes.

Clients train without per-example clipping: privacy is client-level, from the server clipping
each update and noising the sum. What trains is chosen by ``local_mode``:

- ``bias``: BiTFiT, every bias plus the classifier head;
- ``lora``: LoRA adapters (peft) on the attention query/value projections, plus the head;
- ``head``: the classifier head on frozen encoder features, which are computed once per
  client and cached (a linear probe; cheap enough for benchmarks with many clients).

The task configuration travels in every message (``ConfigRecord``), so the same ClientApp
works in the simulation engine and on a real deployment without a run config.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch

from dpfit.federated.clipping import clip_update, one_hot_vote

logger = logging.getLogger(__name__)

LOCAL_MODES = ("bias", "lora", "head")


class ClientTaskError(ValueError):
    """The task configuration sent to a client is invalid."""


@dataclass(frozen=True)
class TaskConfig:
    """What every client and the server agree on; flat scalars so it fits a ConfigRecord."""

    model: str = ""  # empty: the bundled all-MiniLM-L6-v2
    local_mode: str = "bias"
    lora_r: int = 4
    max_length: int = 48
    local_epochs: int = 1
    local_batch_size: int = 16
    lr: float = 1e-3
    num_clients: int = 20
    partition: str = "iid"
    alpha: float = 0.5
    examples_per_client: int = 32
    eval_examples: int = 200
    seed: int = 0
    threads: int = 1

    def __post_init__(self) -> None:
        if self.local_mode not in LOCAL_MODES:
            raise ClientTaskError(
                f"local_mode must be one of {LOCAL_MODES}, got {self.local_mode!r}"
            )

    def to_record(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_record(cls, record: Any) -> TaskConfig:
        names = {f.name: f.type for f in fields(cls)}
        kwargs = {}
        for name in names:
            if name in record:
                default = getattr(cls, name)
                kwargs[name] = type(default)(record[name])
        return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


@dataclass
class LocalModel:
    """A classifier, its tokenizer, and the names of the parameters that train (fixed order)."""

    model: torch.nn.Module
    tokenizer: Any
    trainable: list[str]
    local_mode: str
    initial: list[np.ndarray] = field(default_factory=list)

    def parameters_by_name(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.model.named_parameters())

    def get_arrays(self) -> list[np.ndarray]:
        named = self.parameters_by_name()
        return [named[n].detach().cpu().numpy().copy() for n in self.trainable]

    def set_arrays(self, arrays: Sequence[np.ndarray]) -> None:
        named = self.parameters_by_name()
        if len(arrays) != len(self.trainable):
            raise ClientTaskError(
                f"got {len(arrays)} arrays for {len(self.trainable)} trainable parameters"
            )
        with torch.no_grad():
            for n, a in zip(self.trainable, arrays, strict=True):
                named[n].copy_(torch.as_tensor(np.asarray(a), dtype=named[n].dtype))


def _model_path(model: str) -> str:
    if model:
        return model
    from dpfit.data.bundled import minilm_path

    return str(minilm_path())


@functools.lru_cache(maxsize=2)
def load_local_model(model: str, local_mode: str, lora_r: int, seed: int) -> LocalModel:
    """Load once per process; the frozen weights never change, the trainables are overwritten.

    The seed fixes LoRA's random A matrices and the head's init identically everywhere.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = _model_path(model)
    torch.manual_seed(seed)
    net = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    tok = AutoTokenizer.from_pretrained(path)
    if local_mode == "lora":
        from peft import LoraConfig, TaskType, get_peft_model

        cfg = LoraConfig(
            task_type=TaskType.SEQ_CLS,
            r=lora_r,
            lora_alpha=2 * lora_r,
            target_modules=["query", "value"],
            lora_dropout=0.0,
        )
        net = get_peft_model(net, cfg)
    else:
        for name, p in net.named_parameters():
            head = name.startswith("classifier.")
            p.requires_grad_(head or (local_mode == "bias" and name.endswith("bias")))
    net.eval()  # no dropout: local steps are deterministic given the data order
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    lm = LocalModel(net, tok, trainable, local_mode)
    lm.initial = lm.get_arrays()
    return lm


def _batches(n: int, size: int, rng: np.random.Generator | None) -> list[np.ndarray]:
    order = rng.permutation(n) if rng is not None else np.arange(n)
    return [order[i : i + size] for i in range(0, n, size)]


class _Features:
    """Frozen-encoder features for ``head`` mode, cached per example set."""

    _cache: dict[tuple[str, int], torch.Tensor] = {}

    @classmethod
    def get(cls, lm: LocalModel, texts: Sequence[str], max_length: int) -> torch.Tensor:
        # the encoder is frozen in head mode: features depend only on which model it is
        source = str(getattr(lm.model.config, "_name_or_path", "")) or f"object-{id(lm.model)}"
        key = (f"{lm.local_mode}:{source}:{hash(tuple(texts))}", max_length)
        if key not in cls._cache:
            enc = _encoder(lm.model)
            outs = []
            with torch.no_grad():
                for idx in _batches(len(texts), 64, None):
                    batch = lm.tokenizer(
                        [texts[i] for i in idx],
                        truncation=True,
                        max_length=max_length,
                        padding=True,
                        return_tensors="pt",
                    )
                    outs.append(enc(**batch)[1])
            cls._cache[key] = torch.cat(outs) if outs else torch.zeros(0)
        return cls._cache[key]


def _encoder(model: torch.nn.Module) -> torch.nn.Module:
    prefix = getattr(model, "base_model_prefix", "bert")
    enc = getattr(model, prefix, None)
    if enc is None:
        raise ClientTaskError(f"head mode needs a model with a .{prefix} encoder")
    return enc


def _logits(lm: LocalModel, texts: Sequence[str], idx: np.ndarray, max_length: int):
    if lm.local_mode == "head":
        feats = _Features.get(lm, texts, max_length)[torch.as_tensor(idx)]
        return lm.model.classifier(feats)
    batch = lm.tokenizer(
        [texts[i] for i in idx],
        truncation=True,
        max_length=max_length,
        padding=True,
        return_tensors="pt",
    )
    return lm.model(**batch).logits


def evaluate(
    lm: LocalModel, texts: Sequence[str], labels: Sequence[int], max_length: int
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of the current parameters."""
    if not texts:
        return math.nan, math.nan
    y = torch.as_tensor(list(labels))
    loss_sum, correct = 0.0, 0
    with torch.no_grad():
        for idx in _batches(len(texts), 64, None):
            logits = _logits(lm, texts, idx, max_length)
            loss_sum += float(torch.nn.functional.cross_entropy(logits, y[idx], reduction="sum"))
            correct += int((logits.argmax(-1) == y[idx]).sum())
    return loss_sum / len(texts), correct / len(texts)


def local_train(
    lm: LocalModel,
    start: Sequence[np.ndarray],
    texts: Sequence[str],
    labels: Sequence[int],
    task: TaskConfig,
    rng: np.random.Generator,
) -> tuple[list[np.ndarray], float]:
    """Train from ``start``; returns (update = new - start, mean training loss)."""
    lm.set_arrays(start)
    named = lm.parameters_by_name()
    params = [named[n] for n in lm.trainable]
    opt = torch.optim.AdamW(params, lr=task.lr, weight_decay=0.0)
    y = torch.as_tensor(list(labels))
    losses = []
    for _ in range(task.local_epochs):
        for idx in _batches(len(texts), task.local_batch_size, rng):
            loss = torch.nn.functional.cross_entropy(
                _logits(lm, texts, idx, task.max_length), y[idx]
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    new = lm.get_arrays()
    lm.set_arrays(start)
    update = [n - np.asarray(s, dtype=n.dtype) for n, s in zip(new, start, strict=True)]
    return update, float(np.mean(losses)) if losses else math.nan


def candidate_losses(
    lm: LocalModel,
    start: Sequence[np.ndarray],
    update: Sequence[np.ndarray],
    texts: Sequence[str],
    labels: Sequence[int],
    candidates: Sequence[float],
    noise_multiplier: float,
    expected_clients: float,
    max_length: int,
    rng: np.random.Generator,
) -> list[float]:
    """Local loss after one simulated noisy aggregate per candidate clip norm.

    The client stands in for all m sampled clients: the simulated aggregate is
    clip(update, c) + N(0, (z c / m)^2), the server's average if every client sent this update.
    """
    out = []
    for c in candidates:
        clipped, _ = clip_update(update, c)
        std = noise_multiplier * c / expected_clients
        trial = [
            np.asarray(s) + u + (rng.normal(0.0, std, size=u.shape).astype(u.dtype) if std else 0)
            for s, u in zip(start, clipped, strict=True)
        ]
        lm.set_arrays(trial)
        out.append(evaluate(lm, texts, labels, max_length)[0])
    lm.set_arrays(start)
    return out


# --------------------------------------------------------------------------------------------
# Flower adapter
# --------------------------------------------------------------------------------------------


def _partition_id(context: Any, task: TaskConfig) -> int:
    cfg = context.node_config
    if "partition-id" in cfg:
        return int(cfg["partition-id"])
    return int(context.node_id) % task.num_clients


def _client_setup(message: Any, context: Any):
    from dpfit.federated.app import client_examples

    cfg = message.content["config"]
    task = TaskConfig.from_record(cfg)
    torch.set_num_threads(max(1, task.threads))
    pid = _partition_id(context, task)
    examples = client_examples(task, pid)
    lm = load_local_model(task.model, task.local_mode, task.lora_r, task.seed)
    start = message.content["arrays"].to_numpy_ndarrays()
    rng = np.random.default_rng([task.seed, pid, int(cfg.get("server_round", 0))])
    texts = [e.text for e in examples]
    labels = [e.label for e in examples]
    return cfg, task, pid, lm, start, rng, texts, labels


def build_client_app():
    """The ClientApp; built in a function so that importing this module needs no flwr."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Any) -> Message:
        cfg, task, pid, lm, start, rng, texts, labels = _client_setup(msg, context)
        metrics: dict[str, Any] = {"num_examples": len(texts), "partition_id": pid}
        if bool(cfg.get("report_loss", False)):
            lm.set_arrays(start)
            metrics["loss_before"] = evaluate(lm, texts, labels, task.max_length)[0]
        if float(cfg.get("fail_probability", 0.0)) > rng.random():
            raise RuntimeError(f"injected client failure on partition {pid}")
        update, train_loss = local_train(lm, start, texts, labels, task, rng)
        metrics["train_loss"] = train_loss
        content = RecordDict({"update": ArrayRecord(update), "metrics": MetricRecord(metrics)})
        return Message(content=content, reply_to=msg)

    @app.query()
    def query(msg: Message, context: Any) -> Message:
        cfg, task, pid, lm, start, rng, texts, labels = _client_setup(msg, context)
        update, _ = local_train(lm, start, texts, labels, task, rng)
        losses = candidate_losses(
            lm,
            start,
            update,
            texts,
            labels,
            list(cfg["candidates"]),
            float(cfg["noise_multiplier"]),
            float(cfg["expected_clients"]),
            task.max_length,
            rng,
        )
        vote = one_hot_vote(losses)
        content = RecordDict({"vote": MetricRecord({"vote": vote, "losses": losses})})
        return Message(content=content, reply_to=msg)

    return app


# Flower loads ClientApps by "module:attribute"; built lazily to keep flwr optional.
def __getattr__(name: str) -> Any:
    if name == "app":
        return build_client_app()
    raise AttributeError(name)

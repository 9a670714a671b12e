"""Flower ClientApp: local fine-tuning of a sequence classifier, and clip-candidate votes.

Clients train without per-example clipping: privacy is client-level, from the server clipping
each update and noising the sum. What trains is chosen by ``local_mode``:

- ``bias``: BiTFiT, every bias plus the classifier head;
- ``lora``: LoRA adapters (peft) on the attention query/value projections, plus the head
  (e.g. the bundled SmolLM2-135M, which has no biases);
- ``head``: the classifier head on frozen backbone features, which are computed once per
  client and cached (a linear probe; cheap enough for benchmarks with many clients);
- ``lora-top``: LoRA adapters on the TOP layer's query/value projections (a BERT-style
  encoder's or a LLaMA-style decoder's such as SmolLM2), that layer's biases if it has any,
  and the head. Everything below the top layer is frozen, so the batched engine
  (``dpfit.federated.batched``) computes it once per example and caches it.

Only the trainable tensors travel: the server's arrays, each update and each vote's trial
parameters are the adapters / biases and the head, in a fixed order.

A reply carries only what the server's private releases use: a training reply the update
(clipped, summed and noised by the server) and, for DP-CLAC, the loss clamped to
[0, L_max] (summed under its own noise); a vote reply the one-hot vote (counted under
noise, sensitivity 1). Training losses, candidate losses and example counts stay local.

The task configuration travels in every message (``ConfigRecord``), so the same ClientApp
works in the simulation engine and on a real deployment without a run config.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dpfit.federated.clipping import clip_update, one_hot_vote
from dpfit.federated.data import PartitionError
from dpfit.federated.examples import client_examples
from dpfit.federated.task_config import (  # noqa: F401 - their old home re-exports them
    LOCAL_MODES,
    LOCAL_OPTIMIZERS,
    ClientTaskError,
    TaskConfig,
)

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

LABEL_NAMES = ("rotten", "fresh")  # the bundled federated task (Rotten Tomatoes), label 0 / 1
EVAL_BATCH = 64
PAD_SLACK = 1.25  # training chunks: padded tokens <= 1.25 x real tokens


@dataclass
class LocalModel:
    """A classifier, its tokenizer, and the names of the parameters that train (fixed order).

    The classifier is dpfit's ``PooledClassifier`` (backbone -> pooling -> zero-initialised
    linear ``head``): the mean of token states for the bundled MiniLM (how that
    sentence-transformers model is read), the last non-pad token for decoders such as
    SmolLM2, found from the attention mask so left and right padding both work.
    """

    model: torch.nn.Module
    tokenizer: Any
    trainable: list[str]
    local_mode: str
    initial: list[np.ndarray] = field(default_factory=list)
    # token ids per text set, so a client's data is tokenised once per process
    encoded: dict[tuple[tuple[str, ...], int], list[list[int]]] = field(default_factory=dict)

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

    def encode(self, texts: Sequence[str], max_length: int) -> list[list[int]]:
        """Token ids of each text (truncated, unpadded); cached for the process."""
        key = (tuple(texts), max_length)
        if key not in self.encoded:
            if len(self.encoded) > 256:  # clients of a long run: keep memory bounded
                self.encoded.clear()
            out = self.tokenizer(list(texts), truncation=True, max_length=max_length)
            self.encoded[key] = [list(ids) for ids in out["input_ids"]]
        return self.encoded[key]

    def batch(self, ids: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """Pad to the longest sequence on the tokenizer's padding side, with the mask."""
        width = max(len(x) for x in ids)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        for row, x in enumerate(ids):
            cols = slice(width - len(x), width) if left else slice(0, len(x))
            input_ids[row, cols] = torch.as_tensor(x, dtype=torch.long)
            mask[row, cols] = 1
        out = {"input_ids": input_ids, "attention_mask": mask}
        if left:  # positions count real tokens only, as with right padding
            out["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        return out


# where a backbone keeps its stack of layers -> peft's ``layers_pattern`` for it
LAYER_STACKS = (("encoder.layer", "layer"), ("layers", "layers"))  # BERT-style, LLaMA-style


def _layer_stack(net: torch.nn.Module) -> tuple[str, str, int]:
    """(path under ``backbone``, peft layers_pattern, number of layers) of the model's layer
    stack: ``encoder.layer`` of a BERT-style encoder, ``layers`` of a LLaMA-style decoder."""
    backbone = getattr(net, "backbone", None)
    for path, pattern in LAYER_STACKS:
        stack = backbone
        for part in path.split("."):
            stack = getattr(stack, part, None)
        if isinstance(stack, torch.nn.ModuleList) and len(stack) > 0:
            return path, pattern, len(stack)
    raise ClientTaskError(
        "local mode 'lora-top' needs a BERT-style encoder (backbone.encoder.layer) or a "
        "LLaMA-style decoder (backbone.layers); use --local-mode lora or bias for this model"
    )


def top_layer_prefix(net: torch.nn.Module) -> str:
    """Name prefix of the top layer: ``backbone.encoder.layer.<L-1>.`` (BERT-style) or
    ``backbone.layers.<L-1>.`` (LLaMA-style decoder)."""
    path, _, count = _layer_stack(net)
    return f"backbone.{path}.{count - 1}."


def _trainable(name: str, local_mode: str, top: str = "") -> bool:
    if name.startswith("head."):
        return True
    if local_mode == "lora-top":
        return name.startswith(top) and ("lora_" in name or name.endswith(".bias"))
    if local_mode == "lora":
        return "lora_" in name
    if local_mode == "bias":
        return name.endswith(".bias")
    return False  # head mode: the head only


def _add_lora(net: torch.nn.Module, rank: int, top_only: bool = False) -> torch.nn.Module:
    """LoRA adapters (peft) on the attention projections peft uses for this model type
    (BERT: query/value; LLaMA: q_proj/v_proj), injected in place: the head stays ours.
    ``top_only``: on the top layer only (local mode ``lora-top``), of a BERT-style encoder
    or a LLaMA-style decoder."""
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as TARGETS

    model_type = getattr(net.config, "model_type", None)
    if model_type not in TARGETS:
        raise ClientTaskError(
            f"LoRA: no default attention projections known for model type {model_type!r}; "
            "use --local-mode bias or head"
        )
    extra: dict[str, Any] = {}
    if top_only:
        _, pattern, count = _layer_stack(net)
        extra = {"layers_to_transform": [count - 1], "layers_pattern": pattern}
    cfg = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=TARGETS[model_type],
        **extra,
    )
    return inject_adapter_in_model(cfg, net)


def task_model(task: TaskConfig, dtype: str = "float32") -> LocalModel:
    """The task's model, with a head for the task's classes (bundled or the user's)."""
    from dpfit.federated.data import label_names

    return load_local_model(
        task.model, task.local_mode, task.lora_r, task.seed, dtype, label_names(task)
    )


def initial_arrays(task: TaskConfig) -> list[np.ndarray]:
    """The trainables as loaded (the cached model's live values change during a run)."""
    lm = task_model(task)
    return [a.copy() for a in lm.initial]


def load_local_model(
    model: str,
    local_mode: str,
    lora_r: int,
    seed: int,
    dtype: str = "float32",
    label_names: tuple[str, ...] = LABEL_NAMES,
) -> LocalModel:
    """Load once per process; the frozen weights never change, the trainables are overwritten.

    ``model``: a folder, hub id or bundled name (``minilm``, ``smollm2``); empty = MiniLM.
    The seed fixes LoRA's random A matrices identically everywhere (the head starts at zero).
    ``dtype`` float64 is for exactness tests (batched engine against the per-client path).
    ``label_names``: the classes of the head (default: the bundled task's). Every call with
    the same settings, however they are passed, gets the same cached model.
    """
    return _load_local_model(model, local_mode, lora_r, seed, dtype, tuple(label_names))


@functools.lru_cache(maxsize=2)
def _load_local_model(
    model: str,
    local_mode: str,
    lora_r: int,
    seed: int,
    dtype: str,
    label_names: tuple[str, ...],
) -> LocalModel:
    from dpfit.models import load_classifier

    loaded = load_classifier(model or None, label_names, seed=seed)
    net = loaded.model
    if local_mode in ("lora", "lora-top"):
        torch.manual_seed(seed)
        net = _add_lora(net, lora_r, top_only=local_mode == "lora-top")
    net = net.to(getattr(torch, dtype))
    top = top_layer_prefix(net) if local_mode == "lora-top" else ""
    for name, p in net.named_parameters():
        p.requires_grad_(_trainable(name, local_mode, top))
    trainable = [n for n, p in net.named_parameters() if p.requires_grad]
    if local_mode != "head" and all(n.startswith("head.") for n in trainable):
        raise ClientTaskError(
            f"local mode {local_mode!r} finds nothing to train in {loaded.source} besides the "
            "head (a model without biases, e.g. LLaMA / SmolLM2, needs --local-mode lora)"
        )
    net.eval()  # no dropout: local steps are deterministic given the data order
    lm = LocalModel(net, loaded.tokenizer, trainable, local_mode)
    lm.initial = lm.get_arrays()
    logger.debug(
        "%s, %s mode: %d trainable tensors, %d values",
        loaded.source,
        local_mode,
        len(trainable),
        sum(a.size for a in lm.initial),
    )
    return lm


def _batches(n: int, size: int, rng: np.random.Generator | None) -> list[np.ndarray]:
    order = rng.permutation(n) if rng is not None else np.arange(n)
    return [order[i : i + size] for i in range(0, n, size)]


def _by_length(ids: Sequence[Sequence[int]], size: int) -> list[np.ndarray]:
    """Evaluation batches of similar lengths: less padding, the same per-example results."""
    order = np.argsort([len(x) for x in ids], kind="stable")
    return [order[i : i + size] for i in range(0, len(order), size)]


def _length_chunks(
    ids: Sequence[Sequence[int]], idx: np.ndarray, slack: float = PAD_SLACK
) -> list[np.ndarray]:
    """Split a batch, sorted by length, into chunks padded to at most ``slack`` x its tokens."""
    chunks: list[list[int]] = []
    cur: list[int] = []
    real = 0
    for i in sorted(idx.tolist(), key=lambda j: len(ids[j])):
        n = len(ids[i])  # the longest so far: the chunk's padded width if i joins
        if cur and n * (len(cur) + 1) > slack * (real + n):
            chunks.append(cur)
            cur, real = [], 0
        cur.append(i)
        real += n
    if cur:
        chunks.append(cur)
    return [np.asarray(c) for c in chunks]


class _Features:
    """Frozen-backbone pooled features for ``head`` mode, cached per example set."""

    _cache: dict[tuple[str, int], torch.Tensor] = {}

    @classmethod
    def get(cls, lm: LocalModel, texts: Sequence[str], max_length: int) -> torch.Tensor:
        # the backbone is frozen in head mode: features depend only on which model it is
        source = str(getattr(lm.model.config, "_name_or_path", "")) or f"object-{id(lm.model)}"
        key = (f"{lm.local_mode}:{source}:{hash(tuple(texts))}", max_length)
        if key not in cls._cache:
            ids = lm.encode(texts, max_length)
            feats = torch.zeros(0)
            # ordinary tensors even when called from evaluate(): the head trains on them
            with torch.inference_mode(False), torch.no_grad():
                for idx in _by_length(ids, EVAL_BATCH):
                    out = lm.model.features(**lm.batch([ids[i] for i in idx]))
                    if feats.numel() == 0:
                        feats = torch.zeros(len(ids), out.shape[-1], dtype=out.dtype)
                    feats[torch.as_tensor(idx)] = out
            cls._cache[key] = feats
        return cls._cache[key]


def _logits(lm: LocalModel, texts: Sequence[str], idx: np.ndarray, max_length: int):
    if lm.local_mode == "head":
        feats = _Features.get(lm, texts, max_length)[torch.as_tensor(idx)]
        return lm.model.head(feats)
    ids = lm.encode(texts, max_length)
    # features then head, not model(...): the same logits, in the model's own dtype
    return lm.model.head(lm.model.features(**lm.batch([ids[i] for i in idx])))


def evaluate(
    lm: LocalModel, texts: Sequence[str], labels: Sequence[int], max_length: int
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of the current parameters."""
    if not texts:
        return math.nan, math.nan
    y = torch.as_tensor(list(labels))
    loss_sum, correct = 0.0, 0
    with torch.inference_mode():
        for idx in _by_length(lm.encode(texts, max_length), EVAL_BATCH):
            logits = _logits(lm, texts, idx, max_length)
            loss_sum += float(torch.nn.functional.cross_entropy(logits, y[idx], reduction="sum"))
            correct += int((logits.argmax(-1) == y[idx]).sum())
    return loss_sum / len(texts), correct / len(texts)


def backward_batch(
    lm: LocalModel,
    texts: Sequence[str],
    ids: Sequence[Sequence[int]],
    y: torch.Tensor,
    idx: np.ndarray,
    max_length: int,
) -> float:
    """Accumulate the gradient of the batch's mean cross-entropy; returns that mean.

    The batch runs in chunks of similar lengths (``_length_chunks``): the same gradient as
    one forward over the batch padded to its longest text, with less padding to compute.
    """
    chunks = _length_chunks(ids, idx) if lm.local_mode != "head" else [idx]
    total = 0.0
    for chunk in chunks:
        logits = _logits(lm, texts, chunk, max_length)
        loss = torch.nn.functional.cross_entropy(logits, y[chunk], reduction="sum") / len(idx)
        loss.backward()
        total += loss.item()
    return total


def make_local_optimizer(name: str, params: list[torch.nn.Parameter], lr: float):
    """The client's optimizer by name: AdamW or plain SGD, both without weight decay."""
    classes = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
    if name not in classes:
        raise ClientTaskError(f"local_optimizer must be one of {sorted(classes)}, got {name!r}")
    return classes[name](params, lr=lr, weight_decay=0.0)


def local_train(
    lm: LocalModel,
    start: Sequence[np.ndarray],
    texts: Sequence[str],
    labels: Sequence[int],
    task: TaskConfig,
    rng: np.random.Generator,
    on_epoch: Callable[[int, list[np.ndarray]], None] | None = None,
) -> tuple[list[np.ndarray], float]:
    """Train from ``start``; returns (update = new - start, mean training loss).

    The update has one array per trainable tensor (adapters or biases, and the head), in the
    order of ``lm.trainable``: nothing frozen travels. ``on_epoch(k, params)``, if given, sees
    a copy of the parameters after each epoch k (1-based) of the one optimizer's run, so a
    benchmark can score several epoch counts in one run; it must not touch ``lm``.
    """
    lm.set_arrays(start)
    named = lm.parameters_by_name()
    params = [named[n] for n in lm.trainable]
    opt = make_local_optimizer(task.local_optimizer, params, task.lr)
    y = torch.as_tensor(list(labels))
    ids = lm.encode(texts, task.max_length)
    losses = []
    for epoch in range(1, task.local_epochs + 1):
        for idx in _batches(len(texts), task.local_batch_size, rng):
            opt.zero_grad(set_to_none=True)
            losses.append(backward_batch(lm, texts, ids, y, idx, task.max_length))
            opt.step()
        if on_epoch is not None:
            on_epoch(epoch, lm.get_arrays())
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


def clamp_loss(loss: float, bound: float) -> float:
    """What DP-CLAC's sum uses of a client's loss: clamped to [0, bound]; 0 if not finite.

    Clamping on the client means the raw loss never leaves it (the server clamps again).
    """
    return float(min(max(loss, 0.0), bound)) if math.isfinite(loss) else 0.0


def _partition_id(context: Any, task: TaskConfig) -> int:
    """The SuperNode's partition, as its node config names it.

    Never derived from the node id: ``node_id % N`` puts one partition on several nodes, so
    one partition could contribute k*C in a round and be sampled more often than q
    Flower's simulation engine sets ``partition-id`` on every node.
    """
    cfg = context.node_config
    if "partition-id" not in cfg:
        raise PartitionError(
            f"SuperNode {context.node_id} was started without a partition id; start each "
            f'SuperNode with --node-config "partition-id=<i> num-partitions={task.num_clients}" '
            f"(i = 0..{task.num_clients - 1}, each on exactly one node)"
        )
    if "num-partitions" in cfg and int(cfg["num-partitions"]) != task.num_clients:
        raise PartitionError(
            f"SuperNode {context.node_id} has num-partitions={cfg['num-partitions']} but the "
            f"run has num-clients={task.num_clients}; start it with "
            f"num-partitions={task.num_clients}"
        )
    return int(cfg["partition-id"])


def _client_setup(message: Any, context: Any):
    cfg = message.content["config"]
    task = TaskConfig.from_record(cfg)
    torch.set_num_threads(max(1, task.threads))
    pid = _partition_id(context, task)
    examples = client_examples(task, pid)
    lm = task_model(task)
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
        """Reply: the update (clipped and noised by the server) and, for DP-CLAC only, the
        loss of the received model clamped to [0, loss_bound] (summed under noise)."""
        cfg, task, pid, lm, start, rng, texts, labels = _client_setup(msg, context)
        metrics: dict[str, Any] = {}
        if bool(cfg.get("report_loss", False)):
            lm.set_arrays(start)
            loss = evaluate(lm, texts, labels, task.max_length)[0]
            metrics["loss_before"] = clamp_loss(loss, float(cfg["loss_bound"]))
        if float(cfg.get("fail_probability", 0.0)) > rng.random():
            raise RuntimeError(f"injected client failure on partition {pid}")
        update, _ = local_train(lm, start, texts, labels, task, rng)
        content = RecordDict({"update": ArrayRecord(update), "metrics": MetricRecord(metrics)})
        return Message(content=content, reply_to=msg)

    @app.query()
    def query(msg: Message, context: Any) -> Message:
        """Reply: the one-hot vote only (the server sums votes under noise, sensitivity 1);
        the candidate losses it is computed from stay on the client."""
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
        content = RecordDict({"vote": MetricRecord({"vote": one_hot_vote(losses)})})
        return Message(content=content, reply_to=msg)

    return app


# Flower loads ClientApps by "module:attribute"; built lazily to keep flwr optional.
def __getattr__(name: str) -> Any:
    if name == "app":
        return build_client_app()
    raise AttributeError(name)

"""The training run behind ``dpfit train``: data -> model -> private (or plain) loop -> report.

One function, :func:`train`, with one frozen :class:`TrainConfig`, so the CLI, the benchmarks
and a user's script run exactly the same code. The private and non-private runs share the
loop; only the stepper differs (the PrivacyEngine with Poisson sampling, or a plain optimizer
over shuffled fixed-size batches), which is what makes their comparison meaningful.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dpfit import checkpoint as ckpt
from dpfit.data.text import LabeledTexts, bundled_rotten_tomatoes, load_texts
from dpfit.distributed import is_main_process
from dpfit.errors import BudgetExhaustedError, DPFitError, NoTrainableParametersError
from dpfit.models import count_bias_parameters, load_classifier
from dpfit.reporting import StepRow, peak_memory_mb, plot_steps, write_json, write_steps_csv

logger = logging.getLogger(__name__)

# The defaults must finish in < 10 minutes on 2 CPU cores: a random subset of the bundled
# training split and a short max length (95% of snippets are under 48 tokens).
DEFAULT_DELTA = 1e-5
CLIPPING = ("flat", "automatic")
MODES = ("bias", "full")
TASKS = ("classification", "causal-lm")
OPTIMIZERS = {
    "adamw": lambda params, lr, wd: torch.optim.AdamW(params, lr=lr, weight_decay=wd),
    "sgd": lambda params, lr, wd: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd),
}


class PhysicalBatchMemoryError(DPFitError, MemoryError):
    """A physical batch did not fit in memory."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a run. Fields marked (resume) may differ on --resume."""

    model: str | None = None  # folder, .gguf file or hub id; None = bundled MiniLM
    data: str | None = None  # CSV/JSONL/datasets folder; None = bundled Rotten Tomatoes
    eval_data: str | None = None  # scored at the end; default: test split / held-out 10%
    text_column: str = "text"
    label_column: str = "label"
    max_train_examples: int | None = None  # random subset of the training data
    epsilon: float | None = 8.0
    delta: float | None = None  # None: min(1e-5, 1/n^1.1)
    noise_multiplier: float | None = None  # overrides epsilon
    accountant: str = "rdp"
    epochs: int = 3
    max_steps: int | None = None  # stop after this many logical steps (privacy sized for it)
    batch_size: int = 256  # logical; expected size under Poisson sampling
    physical_batch_size: int = 32
    max_grad_norm: float = 1.0
    clipping: str = "flat"
    lr: float = 2e-3
    optimizer: str = "adamw"  # adamw | sgd (momentum 0.9)
    weight_decay: float = 0.0
    max_length: int = 48
    seed: int = 0
    non_private: bool = False
    mode: str = "bias"
    add_biases: bool = False  # BiTFiT-Add (issue #5)
    full_epochs: int = 0  # two-phase: full fine-tuning first (issue #5)
    task: str = "classification"
    output: str | None = None  # (resume)
    checkpoint_dir: str | None = None  # (resume)
    checkpoint_every: int = 1  # (resume) logical steps between checkpoints
    resume: bool = False  # (resume)
    device: str = "auto"  # (resume)
    eval_batch_size: int = 64  # (resume)

    def __post_init__(self) -> None:
        if self.clipping not in CLIPPING:
            raise ValueError(f"clipping must be one of {CLIPPING}, got {self.clipping!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"optimizer must be one of {sorted(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        for name in (
            "epochs",
            "batch_size",
            "physical_batch_size",
            "max_length",
            "checkpoint_every",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        if not self.non_private and self.noise_multiplier is None and self.epsilon is None:
            raise ValueError("give a target epsilon or a noise multiplier (or non_private)")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint_dir")

    # Settings that may change between a run and its resumption without changing the result.
    RESUMABLE = (
        "output",
        "checkpoint_dir",
        "checkpoint_every",
        "resume",
        "device",
        "eval_batch_size",
    )

    def fingerprint(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if k not in self.RESUMABLE}


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    n: int
    per_class: dict[str, dict[str, int]]  # name -> {"n", "correct", "predicted"}

    def as_dict(self) -> dict:
        return {"accuracy": self.accuracy, "n": self.n, "per_class": self.per_class}


@dataclass
class TrainResult:
    metrics: dict
    steps: list[StepRow]
    model: object
    tokenizer: object
    privacy: dict | None
    notes: list[str] = field(default_factory=list)
    output_dir: Path | None = None


# -- data ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedData:
    train: LabeledTexts
    test: LabeledTexts
    notes: tuple[str, ...]


def prepare_data(config: TrainConfig) -> PreparedData:
    """Training and evaluation texts for `config`, with notes on any subsampling or split."""
    notes: list[str] = []
    if config.data is None:
        splits = bundled_rotten_tomatoes(seed=config.seed)
        train, test = splits.train, splits.test
        notes.append(
            f"data: bundled Rotten Tomatoes, split by movie (seed {config.seed}): "
            f"{len(splits.train)} train / {len(splits.validation)} validation / {len(test)} test"
        )
    else:
        train = load_texts(config.data, config.text_column, config.label_column)
        if config.eval_data is None:
            if len(train) < 10:
                raise DPFitError(
                    f"{config.data} has {len(train)} examples, too few to hold out a test "
                    "set; pass --eval-data"
                )
            train, test = train.split(0.1, seed=config.seed)
            notes.append(
                f"no --eval-data: holding out a random 10% of {config.data} as the test set "
                f"({len(test)} examples)"
            )
    if config.eval_data is not None:
        test = load_texts(
            config.eval_data, config.text_column, config.label_column, label_names=train.label_names
        )
    if config.max_train_examples is not None and config.max_train_examples < len(train):
        notes.append(
            f"training on a random {config.max_train_examples} of {len(train)} training examples "
            "(--full-data or --max-train-examples to change)"
        )
        train = train.subsample(config.max_train_examples, seed=config.seed)
    return PreparedData(train, test, tuple(notes))


def encode(data: LabeledTexts, tokenizer, max_length: int) -> list[dict]:
    """Tokenise once up front; items are unpadded so each batch pads only to its own length."""
    enc = tokenizer(list(data.texts), truncation=True, max_length=max_length)
    keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc]
    return [
        {**{k: enc[k][i] for k in keys}, "labels": label} for i, label in enumerate(data.labels)
    ]


def make_collate(pad_token_id: int, position_ids: bool = False) -> Callable[[list[dict]], dict]:
    """Pad a list of encoded examples. With `position_ids`, also pass them per example: full
    mode needs every input with its batch axis (a broadcast (1, L) one mixes examples)."""

    def collate(items: list[dict]) -> dict:
        width = max((len(it["input_ids"]) for it in items), default=0)
        out: dict[str, torch.Tensor] = {}
        for key in items[0] if items else ():
            if key == "labels":
                out[key] = torch.tensor([it[key] for it in items], dtype=torch.long)
                continue
            pad = pad_token_id if key == "input_ids" else 0
            out[key] = torch.tensor(
                [it[key] + [pad] * (width - len(it[key])) for it in items], dtype=torch.long
            )
        if position_ids and items:
            out["position_ids"] = torch.arange(width).expand(len(items), width).clone()
        return out

    return collate


# -- evaluation ------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    data: LabeledTexts,
    max_length: int = 128,
    batch_size: int = 64,
    device: str | torch.device = "cpu",
) -> EvalResult:
    """Accuracy and per-class counts; batches sorted by length so padding costs little."""
    items = encode(data, tokenizer, max_length)
    order = sorted(range(len(items)), key=lambda i: len(items[i]["input_ids"]))
    collate = make_collate(tokenizer.pad_token_id)
    was_training = model.training
    model.eval()
    preds = [0] * len(items)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = collate([items[i] for i in idx])
        batch.pop("labels")
        logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        for i, p in zip(idx, logits.argmax(-1).tolist(), strict=True):
            preds[i] = p
    model.train(was_training)
    per_class = {n: {"n": 0, "correct": 0, "predicted": 0} for n in data.label_names}
    correct = 0
    names = data.label_names
    for p, y in zip(preds, data.labels, strict=True):
        per_class[names[y]]["n"] += 1
        if 0 <= p < len(names):
            per_class[names[p]]["predicted"] += 1
        if p == y:
            per_class[names[y]]["correct"] += 1
            correct += 1
    return EvalResult(correct / len(items) if items else float("nan"), len(items), per_class)


# -- the non-private stepper: same loop, no clipping or noise ---------------------------------


class ShuffledBatches:
    """Fixed-size shuffled logical batches split into physical ones; resumable by position.

    The order of a pass depends only on (seed, epoch), so the state is two integers.
    """

    def __init__(
        self, dataset: Sequence, batch_size: int, physical_batch_size: int, collate, seed: int
    ):
        self.dataset = dataset
        self.batch_size = batch_size
        self.physical_batch_size = physical_batch_size
        self.collate = collate
        self.seed = seed
        self.epoch = 0
        self.position = 0  # logical batches completed in this epoch
        self.last_chunk = False
        self.logical_size = 0

    def __len__(self) -> int:
        return math.ceil(len(self.dataset) / self.batch_size)

    def __iter__(self) -> Iterator[dict]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        perm = torch.randperm(len(self.dataset), generator=gen).tolist()
        while self.position < len(self):
            idx = perm[self.position * self.batch_size : (self.position + 1) * self.batch_size]
            self.position += 1
            self.logical_size = len(idx)
            chunks = [
                idx[i : i + self.physical_batch_size]
                for i in range(0, len(idx), self.physical_batch_size)
            ]
            for j, chunk in enumerate(chunks):
                self.last_chunk = j == len(chunks) - 1
                batch = self.collate([self.dataset[i] for i in chunk])
                batch["_weight"] = len(chunk) / len(idx)
                yield batch
        self.position = 0
        self.epoch += 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch, self.position = int(sd["epoch"]), int(sd["position"])


class PlainStepper:
    """The `engine.step` contract without privacy: step the optimizer after each logical batch."""

    def __init__(self, loader: ShuffledBatches):
        self.loader = loader
        self.steps_taken = 0

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        if not self.loader.last_chunk:
            return False
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.steps_taken += 1
        return True

    def epsilon(self) -> float:
        return math.inf

    def state_dict(self) -> dict:
        return {"steps_taken": self.steps_taken}

    def load_state_dict(self, sd: dict) -> None:
        self.steps_taken = int(sd["steps_taken"])


# -- the run ---------------------------------------------------------------------------------


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and (
        "out of memory" in msg or "can't allocate memory" in msg or "not enough memory" in msg
    )


def _oom_error(config: TrainConfig, e: BaseException) -> PhysicalBatchMemoryError:
    smaller = max(1, config.physical_batch_size // 2)
    return PhysicalBatchMemoryError(
        f"a physical batch of up to {config.physical_batch_size} examples (max length "
        f"{config.max_length}) did not fit in memory; retry with --physical-batch-size {smaller} "
        "(the logical batch and the privacy guarantee stay the same) or a smaller --max-length. "
        f"({type(e).__name__}: {str(e)[:200]})"
    )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # pragma: no cover
        pass


def _task_hook(config: TrainConfig):
    """Hooks for issue #5's features: other tasks and two-phase schedules run elsewhere.

    `--task causal-lm` is delegated to ``dpfit.causal_lm.train_from_config(config)`` when that
    module provides it; `--full-epochs` needs the phase switch of ``dpfit.schedule`` wired into
    this loop. Until then both stop with a message instead of silently training something else.
    """
    if config.task != "classification":
        try:
            from dpfit import causal_lm
        except ImportError as e:
            raise DPFitError(f"--task {config.task} needs dpfit.causal_lm (issue #5): {e}") from e
        run = getattr(causal_lm, "train_from_config", None)
        if run is None:
            raise DPFitError(
                f"--task {config.task} is not wired into `dpfit train` yet; use "
                "dpfit.causal_lm.train_causal_lm(model, tokenizer, lines, CausalLMConfig(...)) "
                "from Python (issue #5)"
            )
        return run(config)
    if config.full_epochs:
        if config.non_private:
            raise DPFitError("--full-epochs schedules a private run; drop --non-private")
        if config.mode != "bias":
            raise DPFitError("--full-epochs X already runs X epochs in full mode; drop --mode")
        if not 0 < config.full_epochs < config.epochs:
            raise DPFitError(
                f"--full-epochs must be between 1 and --epochs - 1 ({config.epochs - 1}), "
                f"got {config.full_epochs}"
            )
    return None


def _prepare_trainables(model, heads: tuple[str, ...], config: TrainConfig):
    """Select what trains; returns a TrainableSummary-like object."""
    import dpfit

    if config.add_biases:
        add = getattr(dpfit, "add_biases", None)
        if add is None:
            raise DPFitError("--add-biases needs dpfit.add_biases (issue #5), not in this build")
        add(model)
    if config.mode == "full":
        for p in model.parameters():
            p.requires_grad_(True)
        from dpfit.params import summarize

        return summarize(model)
    if not config.add_biases and count_bias_parameters(model, exclude=heads) == 0:
        raise NoTrainableParametersError(
            f"{config.model or 'the model'} has no bias terms outside its head, so bias-only "
            "training would train the head alone; add zero-initialised biases with --add-biases "
            "(dpfit.add_biases), or use --mode full"
        )
    return dpfit.make_bias_trainable(model, train_head=heads)


def _enter_bias_phase(engine, optimizer, note: Callable[[str], None]):
    """Second phase of X+BiTFiT: bias-only from here on, same ledger, rebuilt optimizer."""
    if engine.mode == "bias":
        return optimizer
    optimizer = engine.switch_phase("bias", optimizer)
    note(
        f"phase switch: full -> bias after {engine.steps_taken} steps (eps {engine.epsilon():.3f})"
    )
    return optimizer


def _make_engine(model, config: TrainConfig, n: int, total_steps: int):
    import dpfit

    delta = config.delta if config.delta is not None else min(DEFAULT_DELTA, n**-1.1)
    kwargs = dict(
        expected_batch_size=min(config.batch_size, n),
        sample_size=n,
        target_delta=delta,
        max_grad_norm=config.max_grad_norm,
        clipping=config.clipping,
        loss_reduction="mean",
        accountant=config.accountant,
        insecure_seed=config.seed,  # TODO(train): only with --insecure-reproducible-noise
    )
    if config.full_epochs:  # two-phase X+BiTFiT: one accountant across both phases
        kwargs["schedule"] = [
            ("full", config.full_epochs),
            ("bias", config.epochs - config.full_epochs),
        ]
    else:
        kwargs["mode"] = config.mode
    if config.noise_multiplier is not None:
        kwargs["noise_multiplier"] = config.noise_multiplier
    else:
        kwargs["target_epsilon"] = config.epsilon
        kwargs["steps"] = total_steps
    return dpfit.PrivacyEngine(model, **kwargs)


def train(
    config: TrainConfig,
    on_step: Callable[[StepRow, int], None] | None = None,
    on_note: Callable[[str], None] | None = None,
) -> TrainResult:
    """Run one training job as configured; see module docstring.

    Args:
        on_step: called after every logical step with (row, total logical steps).
        on_note: called with human-readable notes (subsampling, held-out split, resume).
    """
    hooked = _task_hook(config)
    if hooked is not None:
        return hooked
    t_start = time.perf_counter()
    notes: list[str] = []

    def note(msg: str) -> None:
        notes.append(msg)
        logger.info(msg)
        if on_note is not None:
            on_note(msg)

    device = _device(config.device)
    _seed_everything(config.seed)
    data = prepare_data(config)
    for n_ in data.notes:
        note(n_)
    loaded = load_classifier(config.model, data.train.label_names, seed=config.seed)
    model, tokenizer = loaded.model, loaded.tokenizer
    summary = _prepare_trainables(model, loaded.head_names, config)
    model.to(device)
    model.train()

    items = encode(data.train, tokenizer, config.max_length)
    full_phase = not config.non_private and (config.mode == "full" or config.full_epochs > 0)
    collate = make_collate(
        tokenizer.pad_token_id,
        position_ids=full_phase and "position_ids" in inspect.signature(model.forward).parameters,
    )
    n = len(items)
    steps_per_epoch = (
        math.ceil(n / config.batch_size)
        if config.non_private
        else max(1, round(n / min(config.batch_size, n)))
    )
    total_steps = config.epochs * steps_per_epoch
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)

    engine = None
    if config.non_private:
        loader = ShuffledBatches(
            items, config.batch_size, config.physical_batch_size, collate, config.seed
        )
        stepper = PlainStepper(loader)
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        engine = _make_engine(model, config, n, total_steps)
        loader = engine.data_loader(
            items,
            collate_fn=collate,
            physical_batch_size=config.physical_batch_size,
            max_steps=total_steps,  # distributed: every rank stops at the same logical step
        )
        stepper = engine
        params = list(engine.parameters())
    optimizer = OPTIMIZERS[config.optimizer](params, config.lr, config.weight_decay)

    rows: list[StepRow] = []
    epoch = 0
    elapsed_before = 0.0
    if config.resume:
        path = ckpt.latest_checkpoint(config.checkpoint_dir)
        if path is None:
            note(f"--resume: no checkpoint in {config.checkpoint_dir}; starting from scratch")
        else:
            state = ckpt.load_checkpoint(path)
            ckpt.check_compatible(
                state["config"], config.fingerprint(), tuple(config.fingerprint())
            )
            ckpt.load_trainable_state(model, state["trainable"])
            if (
                engine is not None
                and config.full_epochs
                and int(state["epoch"]) >= config.full_epochs
            ):
                optimizer = _enter_bias_phase(engine, optimizer, note)
            optimizer.load_state_dict(state["optimizer"])
            stepper.load_state_dict(state["stepper"])
            loader.load_state_dict(state["loader"])
            ckpt.set_rng_state(state["rng"])
            rows = [StepRow(**r) for r in state["rows"]]
            epoch = int(state["epoch"])
            elapsed_before = float(state["elapsed_s"])
            note(f"resumed from {path.name}: logical step {len(rows)}, epoch {epoch + 1}")

    def save(epoch_now: int) -> None:
        if not config.checkpoint_dir or not is_main_process():  # distributed: rank 0 writes
            return
        ckpt.save_checkpoint(
            config.checkpoint_dir,
            stepper.steps_taken,
            {
                "config": config.fingerprint(),
                "trainable": ckpt.trainable_state(model, everything=config.full_epochs > 0),
                "optimizer": optimizer.state_dict(),
                "stepper": stepper.state_dict(),
                "loader": loader.state_dict(),
                "rng": ckpt.rng_state(),
                "rows": [dataclasses.asdict(r) for r in rows],
                "epoch": epoch_now,
                "elapsed_s": elapsed_before + time.perf_counter() - t_loop,
            },
        )

    t_loop = time.perf_counter()
    acc_loss, acc_n = 0.0, 0

    def record(epoch_now: int) -> None:
        nonlocal acc_loss, acc_n
        eps = stepper.epsilon()
        while len(rows) < stepper.steps_taken:
            current = len(rows) == stepper.steps_taken - 1  # the step this batch finished
            rows.append(
                StepRow(
                    step=len(rows) + 1,
                    epoch=epoch_now + 1,
                    loss=acc_loss / acc_n if (current and acc_n) else float("nan"),
                    epsilon=eps,
                    batch_size=acc_n if current else 0,  # earlier ones: empty Poisson batches
                    elapsed_s=elapsed_before + time.perf_counter() - t_loop,
                )
            )
            if on_step is not None:
                on_step(rows[-1], total_steps)
        acc_loss, acc_n = 0.0, 0

    stopped = len(rows) >= total_steps
    try:
        while epoch < config.epochs and not stopped:
            if engine is not None and config.full_epochs and epoch >= config.full_epochs:
                optimizer = _enter_bias_phase(engine, optimizer, note)
            for batch in loader:
                weight = batch.pop("_weight", 1.0)
                bsz = int(batch["labels"].shape[0])
                batch = {k: v.to(device) for k, v in batch.items()}
                try:
                    loss = model(**batch).loss
                    (loss * weight).backward()
                except (RuntimeError, MemoryError) as e:
                    if _is_oom(e):
                        raise _oom_error(config, e) from e
                    raise
                acc_loss += float(loss.detach()) * bsz
                acc_n += bsz
                if stepper.step(optimizer):
                    # empty Poisson batches are noise-only steps the engine takes on its own
                    record(epoch)
                    if len(rows) % config.checkpoint_every == 0 or len(rows) >= total_steps:
                        save(epoch)
                    if len(rows) >= total_steps:
                        stopped = True
                        break
            else:
                epoch += 1
                record(epoch - 1)  # trailing empty batches of the pass, if any
                if len(rows) >= total_steps:
                    stopped = True
    except BudgetExhaustedError as e:
        note(f"stopped early: {e}")
    train_time = elapsed_before + time.perf_counter() - t_loop

    privacy = None
    if engine is not None:
        privacy = dict(engine.privacy_record())
        engine.detach()
    accuracy = evaluate(
        model, tokenizer, data.test, config.max_length, config.eval_batch_size, device
    )
    metrics = _metrics(config, data, summary, accuracy, privacy, rows, train_time, t_start, device)
    result = TrainResult(metrics, rows, model, tokenizer, privacy, notes)
    if config.output and is_main_process():  # distributed: rank 0 writes
        result.output_dir = save_outputs(result, config)
    return result


def _metrics(config, data, summary, accuracy, privacy, rows, train_time, t_start, device) -> dict:
    last_eps = rows[-1].epsilon if rows else 0.0
    m = {
        "accuracy": accuracy.accuracy,
        "eval_n": accuracy.n,
        "per_class": accuracy.per_class,
        "eval_source": data.test.source,
        "private": not config.non_private,
        "epsilon": (privacy or {}).get("epsilon", last_eps) if privacy else math.inf,
        "delta": (privacy or {}).get("delta"),
        "noise_multiplier": (privacy or {}).get("noise_multiplier"),
        "sample_rate": (privacy or {}).get("sample_rate"),
        "max_grad_norm": None if config.non_private else config.max_grad_norm,
        "clipping": None if config.non_private else config.clipping,
        "steps": len(rows),
        "epochs": config.epochs,
        "batch_size": config.batch_size,
        "train_examples": len(data.train),
        "trainable_params": summary.trainable,
        "total_params": summary.total,
        "trainable_fraction": summary.fraction,
        "mode": config.mode,
        "train_time_s": train_time,
        "wall_time_s": time.perf_counter() - t_start,
        "peak_memory_mb": peak_memory_mb(device.type),
        "final_loss": next((r.loss for r in reversed(rows) if not math.isnan(r.loss)), None),
        "config": dataclasses.asdict(config),
    }
    return m


def save_outputs(result: TrainResult, config: TrainConfig) -> Path:
    """DIR/metrics.json, DIR/steps.csv, DIR/{loss,epsilon}.png and DIR/model (+ dpfit.json)."""
    out = Path(config.output)
    out.mkdir(parents=True, exist_ok=True)
    save_model(result.model, result.tokenizer, out / "model", result.privacy, result.metrics)
    write_steps_csv(out / "steps.csv", result.steps)
    plot_steps(result.steps, out)
    write_json(out / "metrics.json", result.metrics)
    return out


def save_model(
    model, tokenizer, folder: str | Path, privacy: dict | None, metrics: dict | None = None
) -> None:
    """A normal transformers folder plus dpfit.json with the privacy record."""
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    record = {"private": privacy is not None, **(privacy or {})}
    if metrics is not None:
        record.setdefault("trainable_fraction", metrics.get("trainable_fraction"))
        record.setdefault("steps", metrics.get("steps"))
        record["mode"] = metrics.get("mode")
    write_json(folder / "dpfit.json", record)

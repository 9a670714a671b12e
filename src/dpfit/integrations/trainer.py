"""Make a transformers ``Trainer`` script private: swap ``Trainer`` for ``DPTrainer``.

    from dpfit.integrations import DPTrainer, PrivacyArguments
    trainer = DPTrainer(model=model, args=training_args, train_dataset=train_ds,
                        data_collator=collator, privacy=PrivacyArguments(target_epsilon=8))
    trainer.train()
    trainer.privacy_engine.epsilon()

What changes, and why (docs/trainer.md has the user's view):
* Batches come from the engine's Poisson loader (what the accountant assumes), not from
  Trainer's shuffled fixed-size loader. ``per_device_train_batch_size`` is the *expected*
  logical batch. ``PrivacyArguments.physical_batch_size`` splits it into physical batches
  (virtual steps): Trainer's loop fetches one item per update, so each item is the whole
  logical batch as ``PhysicalBatches``, and ``training_step`` runs a forward/backward per
  physical batch, clipping each into the engine's sum; the optimizer step adds the one noise
  draw of the logical step. Memory is that of one physical batch; accounting is unchanged.
* Noise and sampling randomness come from the OS (``TrainingArguments.seed`` only seeds
  public things such as dropout); ``PrivacyArguments.insecure_seed`` makes them reproducible
  and the run not private against anyone who knows that seed.
* ``optimizer.step()`` becomes ``engine.step(optimizer)`` through a thin optimizer wrapper
  (clip per example, add noise, step, account); Trainer's own gradient clipping is turned off
  on a copy of the arguments, since clipping the summed gradient is not DP and would corrupt
  the engine's consistency check. Gradient accumulation > 1 is refused for the same reason
  (its fixed count of batches per update is not a Poisson batch; use physical_batch_size).
* The training loss is a mean over examples of each example's own loss (dpfit.integrations
  .losses): a model's own token-level loss weights an example by its neighbours' lengths.
* Only released or public figures are logged: the raw gradient norm, the training loss (unless
  ``log_train_loss=True``), FLOP and token counts are not. Logs gain ``epsilon``.
* Each Trainer checkpoint also holds ``dpfit_engine.pt`` (the ledger; generator states only
  for an insecure seed); resuming needs it, so epsilon after a resume counts every step. A
  resume draws fresh noise and batches and marks the checkpoint as continued: resuming it a
  second time is a fork, refused unless ``PrivacyArguments.allow_fork``.
* Under torchrun, the logical batch is per_device_train_batch_size x world size, each rank
  keeps its part of one global Poisson sample, the engine reduces clipped sums once per step (rank 0 adds the noise),
  each training step runs under DDP's ``no_sync()`` (DDP never averages raw gradients), and an
  empty share is still a step (EMPTY_BATCH), so every rank counts the same steps.
* ``PrivacyArguments(privacy_unit="document")``: each train_dataset item is a document, a
  sequence of rows (the windows of a long text, each what the data collator takes). The
  engine's loader samples documents and reports each row's document with every physical
  batch, so the engine sums a document's rows (across physical batches) and clips the sum
  once; n, q and the expected batch count documents, and epsilon protects a whole document.
  The number of rows (windows) follows the private texts' lengths and is never logged.
* ``PrivacyArguments(privacy_unit="user", user_column="user_id")``: train_dataset is a dataset
  of rows (a ``datasets.Dataset`` or a list of dicts) whose ``user_id`` says whose each row is.
  DPTrainer groups the rows into one document per user itself (at most ``max_rows_per_user``
  of a user's rows, chosen by a keyed hash of each row), then trains as with documents: users
  are sampled, a user's rows summed and clipped as one; n counts users, and epsilon protects
  everything one user contributed. dpfit.json says ``privacy_unit: "user"`` and ``users``.
The user's model gets bias-only training (plus its new head) unless ``bias_only=False``; the
user's ``TrainingArguments`` object is not modified.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    HubStrategy,
    TrainOutput,
    get_last_checkpoint,
)

from dpfit import checkpoint as ckpt
from dpfit import distributed
from dpfit.checkpoint import Continuation, claim_continuation, fork_report, load_checkpoint
from dpfit.config import PRIVACY_UNITS as ENGINE_UNITS
from dpfit.data.text import MAX_ROWS_PER_USER, rows_within_cap, user_groups
from dpfit.engine import PrivacyEngine
from dpfit.errors import DPFitError, LossReductionError
from dpfit.integrations.losses import LossInputs, per_example_loss_for
from dpfit.models import head_module_names
from dpfit.params import make_bias_trainable
from dpfit.recipe import default_delta
from dpfit.sampling import EmptyBatch, PhysicalBatches

logger = logging.getLogger(__name__)

ENGINE_STATE_NAME = "dpfit_engine.pt"

# what epsilon protects: the engine's units, and "user" (rows grouped per user by DPTrainer,
# then sampled and clipped as the engine's documents)
PRIVACY_UNITS = (*ENGINE_UNITS, "user")

# Log keys that are public: schedule and progress counters, the accounted epsilon, and wall
# time (a side channel anyone watching the process has). Everything else a training step logs
# is a function of the private batch (loss, raw gradient norm, FLOP and token counts) and is
# dropped; evaluation metrics pass under their prefix (the evaluation data is not protected).
PUBLIC_LOG_KEYS = frozenset(
    {
        "epoch",
        "step",
        "learning_rate",
        "epsilon",
        "dp_steps",
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
    }
)
TRAIN_LOSS_KEYS = frozenset({"loss", "train_loss"})


class MissingPrivacyStateError(DPFitError):
    """A checkpoint to resume from lacks the privacy engine's state (ledger, generators)."""


class NoCheckpointError(DPFitError):
    """Resuming was asked for but there is no checkpoint: starting over would spend the
    privacy budget a second time, so it is an error, never a silent fresh start."""


@dataclass(frozen=True)
class PrivacyArguments:
    """The privacy half of a DPTrainer's configuration."""

    target_epsilon: float | None = 8.0
    # None: dpfit train's rule, min(1e-5, n^-1.1) for n training units (below 1/n at any n)
    target_delta: float | None = None
    noise_multiplier: float | None = None  # overrides target_epsilon
    max_grad_norm: float = 1.0
    clipping: str = "flat"
    accountant: str = "rdp"
    # the relation target_epsilon is met for; dpfit.json reports both (docs/threat-model.md)
    neighbouring: str = "add-remove"
    bias_only: bool = True
    train_head: tuple[str, ...] | None = None  # None: the model's classification head, if any
    # Seeds noise and Poisson sampling: the run is then NOT private against anyone who knows
    # it. None (default): both come from the OS. TrainingArguments.seed is never used for them.
    insecure_seed: int | None = None
    secure_rng: bool = False
    # Log the exact training loss (a non-private statistic of the sampled batches).
    log_train_loss: bool = False
    # Resume from a checkpoint that was already continued (a fork): each continuation draws
    # fresh noise, and releasing several costs each one's own steps (dpfit.json: continuation).
    allow_fork: bool = False
    # Largest forward/backward batch per device (virtual steps): a logical batch is processed
    # in physical batches of at most this many examples, clipped into one sum and noised once.
    # None: each logical batch is one forward/backward. Privacy and the update do not change.
    physical_batch_size: int | None = None
    # What epsilon protects. "example": each train_dataset item. "document": each item is a
    # document, a sequence of rows (e.g. the windows of a long text, each what the data
    # collator takes); documents are sampled, a document's rows are summed and clipped as one
    # contribution, and the batch size and n count documents (physical_batch_size: rows).
    privacy_unit: str = "example"
    # privacy_unit="user": the train_dataset column that says whose each row is; DPTrainer
    # groups the rows per user, keeping at most max_rows_per_user of each user's rows (None:
    # dpfit.data.text.MAX_ROWS_PER_USER), chosen by a keyed hash of each row
    user_column: str | None = None
    max_rows_per_user: int | None = None

    def __post_init__(self) -> None:
        if self.privacy_unit not in PRIVACY_UNITS:
            raise DPFitError(
                f"privacy_unit must be one of {PRIVACY_UNITS}, got {self.privacy_unit!r}: "
                "'example' protects each train_dataset item, 'document' a whole document "
                "(each train_dataset item a list of rows, e.g. the windows of one long text), "
                "'user' everything one user contributed (with user_column)"
            )
        if (self.privacy_unit == "user") != (self.user_column is not None):
            raise DPFitError(
                "privacy_unit='user' and user_column go together: user_column names the "
                "train_dataset column that says whose each row is (e.g. "
                "PrivacyArguments(privacy_unit='user', user_column='user_id'))"
            )
        if self.max_rows_per_user is not None and (
            self.privacy_unit != "user" or self.max_rows_per_user < 1
        ):
            raise DPFitError(
                "max_rows_per_user is a positive number of rows, with privacy_unit='user', "
                f"got {self.max_rows_per_user} with privacy_unit={self.privacy_unit!r}"
            )
        if self.physical_batch_size is not None and self.physical_batch_size < 1:
            raise DPFitError(
                f"physical_batch_size must be a positive number of examples or None, got "
                f"{self.physical_batch_size}"
            )


class DPOptimizer(torch.optim.Optimizer):
    """Routes ``step()`` through ``engine.step(inner)``; everything else is the inner optimizer.

    It shares ``param_groups`` and ``state`` with the inner optimizer, so learning-rate
    schedulers built on it change the inner optimizer's learning rate.
    """

    def __init__(self, inner: torch.optim.Optimizer, engine: PrivacyEngine):  # noqa: D107
        # No super().__init__: it would re-register the parameters; share the inner state.
        self.inner = inner
        self.engine = engine
        self.empty = False  # the batch of this step was EMPTY_BATCH (no forward/backward)
        self.defaults = inner.defaults
        self.param_groups = inner.param_groups
        self.state = inner.state
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self._optimizer_state_dict_pre_hooks = {}
        self._optimizer_state_dict_post_hooks = {}
        self._optimizer_load_state_dict_pre_hooks = {}
        self._optimizer_load_state_dict_post_hooks = {}

    def step(self, closure=None):  # type: ignore[override]
        if closure is not None:
            raise DPFitError("DPOptimizer.step does not take a closure")
        if self.empty:
            self.empty = False
            return self.engine.empty_step(self.inner)
        return self.engine.step(self.inner)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"DPOptimizer({self.inner!r})"


class _PassLoader:
    """One item per logical step, EMPTY_BATCH for an empty one, so that Trainer's step count is
    the engine's on every rank. Trainer stops pulling after len() items, leaving the Poisson
    pass undrained; finish it (it draws nothing more) before the next pass.

    After a resume the sampler continues mid-pass from its saved position, so this yields only
    the pass's remaining batches (Trainer's own batch skipping is turned off).
    """

    def __init__(self, loader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        sampler = self.loader.sampler
        if sampler.state_dict()["position"] >= len(sampler):
            for _ in self.loader:
                pass
        yield from self.loader


class _EpochFromSteps(TrainerCallback):
    """Trainer counts the epoch from batches seen in this call, which is short after a resume
    (its own batch skipping is off); one update is one logical step, so count from those."""

    def __init__(self, steps_per_epoch: int):
        self.steps_per_epoch = steps_per_epoch

    def on_step_end(self, args, state, control, **kwargs):
        state.epoch = state.global_step / self.steps_per_epoch


def _check_training_arguments(targs) -> None:
    if targs.gradient_accumulation_steps != 1:
        raise DPFitError(
            "DPTrainer needs gradient_accumulation_steps=1: the Poisson logical batch is "
            "per_device_train_batch_size; accumulation would change what one noised step is. "
            "To bound memory, set PrivacyArguments(physical_batch_size=...) instead"
        )
    if targs.include_num_input_tokens_seen not in ("no", False, None):
        raise DPFitError(
            "DPTrainer does not count input tokens (include_num_input_tokens_seen): the count "
            "of tokens in Poisson-sampled batches is an un-noised statistic of the private "
            "data. Leave include_num_input_tokens_seen='no'."
        )
    if targs.push_to_hub and targs.hub_strategy in (
        HubStrategy.CHECKPOINT,
        HubStrategy.ALL_CHECKPOINTS,
    ):
        raise DPFitError(
            f"hub_strategy={targs.hub_strategy.value!r} uploads whole checkpoints, and a "
            f"DPTrainer checkpoint holds {ENGINE_STATE_NAME} (noise and sampler generator "
            "state), which must stay secret. Use hub_strategy='every_save' or 'end' (model "
            "files only)."
        )


def _check_documents(dataset) -> None:
    """privacy_unit="document": the dataset's items must be documents (sequences of rows).
    A dataset of rows (a datasets.Dataset, dicts) would have each row's fields or tokens
    taken as its rows; refused before anything is sampled. Every item is looked at, since a
    row left among documents would otherwise fail (or be taken apart) only once drawn."""
    for i in range(len(dataset)):  # the engine refuses an empty dataset
        item = dataset[i]
        if isinstance(item, Mapping | str | bytes) or not (
            hasattr(item, "__len__") and hasattr(item, "__iter__")
        ):
            raise DPFitError(
                "PrivacyArguments(privacy_unit='document') needs a train_dataset whose items "
                "are documents, each a list of rows (e.g. the windows of one long text, each "
                f"row what data_collator takes); its item {i} is a {type(item).__name__}. "
                "Group the rows by document (train_dataset=[[row, row], [row], ...]), or use "
                "privacy_unit='example'"
            )


class DPTrainer(Trainer):
    """A ``Trainer`` whose training steps are DP-SGD steps of a dpfit ``PrivacyEngine``."""

    def __init__(self, *args: Any, privacy: PrivacyArguments | None = None, **kwargs: Any):
        self.privacy = privacy or PrivacyArguments()
        targs = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
        if targs is None:
            raise DPFitError("DPTrainer needs TrainingArguments (args=...)")
        _check_training_arguments(targs)
        targs = copy.copy(targs)
        targs.max_grad_norm = 0.0  # per-example clipping replaces Trainer's global clipping
        # the restored Poisson sampler resumes mid-pass itself; Trainer must not skip batches
        targs.ignore_data_skip = True
        if "args" in kwargs:
            kwargs["args"] = targs
        else:
            args = (args[0], targs, *args[2:])
        model = kwargs.get("model") if "model" in kwargs else (args[0] if args else None)
        if model is None:
            raise DPFitError("DPTrainer needs a model (no model_init)")
        self._task, self._per_example_loss = per_example_loss_for(model)
        train_dataset = kwargs.get("train_dataset", args[3] if len(args) > 3 else None)
        if self.privacy.privacy_unit == "document" and train_dataset is not None:
            _check_documents(train_dataset)  # before the model's trainables are changed
        loss_func = kwargs.get("compute_loss_func", args[7] if len(args) > 7 else None)
        if loss_func is not None:
            raise LossReductionError(
                "DPTrainer computes a per-example loss itself and cannot use compute_loss_func "
                "(its batch loss need not split per example). Register the per-example loss "
                "with dpfit.integrations.register_per_example_loss(model_class, fn) instead."
            )
        self._eval_prefixes = {"eval"}
        self._resumed_loader_state: dict | None = None
        self._continuation: Continuation | None = None
        self._resumed_from: str | None = None  # the run folder of the checkpoint continued
        if self.privacy.bias_only:
            heads = self.privacy.train_head
            make_bias_trainable(
                model, train_head=head_module_names(model) if heads is None else heads
            )
        super().__init__(*args, **kwargs)  # under torchrun this joins the process group
        if self.train_dataset is None:
            raise DPFitError("DPTrainer needs a train_dataset (its size sets the sampling rate)")
        if self.privacy.privacy_unit == "user":  # rows -> one document per user
            self.train_dataset = self._group_users(self.train_dataset)
        ctx = distributed.resolve(None)
        if ctx is not None:  # as DDP would when it wraps the model: every rank starts equal
            distributed.broadcast_module(self.model, ctx)
        self._dp_optimizer: DPOptimizer | None = None
        self.privacy_engine = self._make_engine()
        self.add_callback(_EpochFromSteps(self.privacy_engine.config.steps_per_epoch))

    def _make_engine(self) -> PrivacyEngine:
        p, a = self.privacy, self.args
        n = len(self.train_dataset)
        kwargs: dict[str, Any] = {}
        if p.noise_multiplier is not None:
            kwargs["noise_multiplier"] = p.noise_multiplier
        else:
            kwargs["target_epsilon"] = p.target_epsilon
            if a.max_steps and a.max_steps > 0:
                kwargs["steps"] = a.max_steps
            else:
                kwargs["epochs"] = a.num_train_epochs
        # one logical batch spans every rank: per_device_train_batch_size is each rank's
        # expected share, as Trainer's batch is per device
        return PrivacyEngine(
            self.model,
            expected_batch_size=min(a.per_device_train_batch_size * a.world_size, n),
            sample_size=n,
            target_delta=p.target_delta if p.target_delta is not None else default_delta(n),
            max_grad_norm=p.max_grad_norm,
            clipping=p.clipping,
            accountant=p.accountant,
            neighbouring=p.neighbouring,
            insecure_seed=p.insecure_seed,  # never TrainingArguments.seed
            secure_rng=p.secure_rng,
            loss_reduction="mean",
            # "document": the engine's loader samples documents and tags each row with its
            # document, so each document is summed and clipped once (dpfit.sampling)
            privacy_unit="document" if p.privacy_unit == "user" else p.privacy_unit,
            **kwargs,
        )

    def _group_users(self, dataset) -> list[list]:
        """privacy_unit="user": the rows of `dataset` as one document per user (users in
        order of their ids), at most max_rows_per_user rows each, chosen by a keyed hash of
        each row (keyed by TrainingArguments.seed, public), never by position or label. The
        user column is dropped from the rows (with the columns the model does not take, for
        a datasets.Dataset under remove_unused_columns)."""
        column = self.privacy.user_column
        names = getattr(dataset, "column_names", None)
        if names is None:
            rows = [dataset[i] for i in range(len(dataset))]
            if any(not isinstance(r, Mapping) for r in rows):
                raise DPFitError(
                    "PrivacyArguments(privacy_unit='user') needs a train_dataset of rows with "
                    f"named fields (a datasets.Dataset or dicts) holding {column!r}"
                )
            missing = next((i for i, r in enumerate(rows) if column not in r), None)
            users = [r.get(column) for r in rows]
        else:
            missing = None if column in names else 0
            users = list(dataset[column]) if missing is None else []
        if missing is not None:
            raise DPFitError(
                f"user_column={column!r} is not a column of train_dataset (row {missing}); "
                "name the column that says whose each row is"
            )
        blank = [i for i, u in enumerate(users) if u is None or not str(u).strip()]
        if blank:
            raise DPFitError(
                f"train_dataset rows {blank[:5]} have no user in {column!r}: every row must "
                "say whose it is, since all of one user's rows are protected together; fill "
                "in their ids, or remove those rows"
            )
        users = [str(u).strip() for u in users]
        if names is not None:
            keep = self.args.remove_unused_columns
            dataset = (
                self._remove_unused_columns(dataset, description="training")
                if keep
                else dataset.remove_columns([column])
            )
            rows = [dataset[i] for i in range(len(dataset))]
        else:
            rows = [{k: v for k, v in r.items() if k != column} for r in rows]
        contents = [json.dumps(r, sort_keys=True, default=str).encode("utf-8") for r in rows]
        cap = self.privacy.max_rows_per_user or MAX_ROWS_PER_USER
        kept = set(rows_within_cap(users, contents, cap, self.args.seed))
        return [[rows[i] for i in g if i in kept] for g in user_groups(users)]

    # ------------------------------------------------------------------ data and steps
    def get_train_dataloader(self):
        dataset = self.train_dataset
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset) and self.args.remove_unused_columns:
                dataset = self._remove_unused_columns(dataset, description="training")
        except ImportError:  # pragma: no cover
            pass
        # one item per logical batch, as Trainer fetches one batch per update: its physical
        # batches (PhysicalBatches), or EMPTY_BATCH for an empty one, so Trainer counts it
        # (its noise-only step is taken in step())
        loader = self.privacy_engine.data_loader(
            dataset,
            collate_fn=self.data_collator,
            physical_batch_size=self.privacy.physical_batch_size,
            yield_empty=True,
            group_physical=True,
        )
        if self._resumed_loader_state is not None:
            loader.load_state_dict(self._resumed_loader_state)
            self._resumed_loader_state = None
        return _PassLoader(loader)

    def create_optimizer(self, model=None):
        opt = super().create_optimizer(model) if model is not None else super().create_optimizer()
        # a second train() finds the DPOptimizer already wrapped by accelerate: wrap only once
        inner = opt
        while inner is not None and not isinstance(inner, DPOptimizer):
            inner = getattr(inner, "optimizer", None)
        if inner is None:
            self.optimizer = inner = DPOptimizer(opt, self.privacy_engine)
        self._dp_optimizer = inner
        return self.optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        """A forward and backward per physical batch of this rank's share of the logical
        batch, with DDP's own gradient all-reduce off: it would average the unclipped
        gradients across ranks, and the engine reduces the clipped sums (plus rank 0's noise)
        once in the optimizer step. Every physical batch but the last is clipped into the
        engine's sum here; the last is clipped by the optimizer step, which then adds the one
        noise draw of the logical step. An EMPTY_BATCH has no forward; the optimizer step
        takes its noise-only step. Returns the mean loss over the logical batch's examples."""
        if self._dp_optimizer is None:  # Trainer creates the optimizer before training
            raise DPFitError("DPTrainer got a training batch before its optimizer existed")
        if isinstance(inputs, EmptyBatch):
            self._dp_optimizer.empty = True
            return torch.zeros((), device=self.args.device)
        if not isinstance(inputs, PhysicalBatches):  # a batch from a user's own loader
            return self._forward_backward(model, inputs)
        total, last = None, len(inputs) - 1
        for i, (size, batch) in enumerate(zip(inputs.sizes, inputs, strict=True)):
            loss = self._forward_backward(model, batch) * size
            total = loss if total is None else total + loss
            if i < last:  # clip into the sum; no release until the logical batch is done
                self.privacy_engine.step(self._dp_optimizer.inner)
        return total / sum(inputs.sizes)

    def _forward_backward(self, model, inputs):
        sync_off = nullcontext
        if isinstance(model, DistributedDataParallel):
            sync_off = model.no_sync
            # a DDP buffer broadcast in every forward is a collective that a rank with an
            # empty batch (no forward) would not join (buffers of a fine-tuned model are
            # fixed); Trainer can only ask for it with DDP's deprecated broadcast_buffers
            distributed.stop_forward_buffer_sync(model)
        with sync_off():
            return super().training_step(model, inputs, None)

    def _get_num_items_in_batch(self, batch_samples, device):
        """Not counted: the loss is a per-example mean, and Trainer would all-gather the label
        count of each Poisson-sampled batch (an un-noised statistic) across ranks."""
        return None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Training: mean over examples of each example's own loss. Evaluation: the model's."""
        if not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if "labels" not in inputs:
            raise LossReductionError(
                "DPTrainer needs a 'labels' entry in each training batch to compute per-example "
                "losses; check the data collator and remove_unused_columns"
            )
        features = {k: v for k, v in inputs.items() if k != "labels"}
        outputs = model(**features)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        per_example = self._per_example_loss(
            LossInputs(
                logits=logits,
                labels=inputs["labels"],
                config=getattr(self.model, "config", None),
                label_smoothing=self.args.label_smoothing_factor,
            )
        )
        loss = per_example.mean()
        return (loss, outputs) if return_outputs else loss

    def floating_point_ops(self, inputs) -> int:
        """Not counted: a FLOP count reveals the token count of each Poisson-sampled batch."""
        return 0

    # ------------------------------------------------------------------ logs
    def _is_released(self, key: str) -> bool:
        if key in PUBLIC_LOG_KEYS:
            return True
        if key in TRAIN_LOSS_KEYS:
            return self.privacy.log_train_loss
        return any(key.startswith(f"{prefix}_") for prefix in self._eval_prefixes)

    def _released(self, logs: dict[str, float]) -> dict[str, float]:
        kept = {k: v for k, v in logs.items() if self._is_released(k)}
        dropped = sorted(set(logs) - set(kept))
        if dropped:
            logger.debug("not logged (un-noised statistics of private data): %s", dropped)
        return kept

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        logs = self._released(logs)
        engine = getattr(self, "privacy_engine", None)
        if engine is not None:
            logs = {**logs, "epsilon": engine.epsilon(), "dp_steps": engine.steps_taken}
        super().log(logs, *args, **kwargs)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        self._eval_prefixes.add(metric_key_prefix)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    # ------------------------------------------------------------------ train, resume, save
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kw):
        """Trainer.train, restoring the privacy engine's state when resuming.

        The returned TrainOutput carries no training loss (NaN) unless ``log_train_loss``.
        """
        checkpoint = self._checkpoint_to_resume(resume_from_checkpoint)
        if checkpoint is not None:
            self._restore_engine(checkpoint)
        out = super().train(
            resume_from_checkpoint=checkpoint if checkpoint is not None else resume_from_checkpoint,
            trial=trial,
            ignore_keys_for_eval=ignore_keys_for_eval,
            **kw,
        )
        if self.privacy.log_train_loss:
            return out
        return TrainOutput(out.global_step, math.nan, self._released(out.metrics))

    def _checkpoint_to_resume(self, resume_from_checkpoint) -> str | None:
        if resume_from_checkpoint is None or resume_from_checkpoint is False:
            return None
        fix = (
            "name a checkpoint-N folder this DPTrainer wrote, or drop resume_from_checkpoint to "
            "start a new run (which spends the privacy budget again)"
        )
        if resume_from_checkpoint is True:
            folder = self.args.output_dir
            found = get_last_checkpoint(folder) if os.path.isdir(folder) else None
            if found is None:
                what = (
                    "does not exist"
                    if not os.path.exists(folder)
                    else f"holds no {PREFIX_CHECKPOINT_DIR}-N folder "
                    f"({len(os.listdir(folder)) if os.path.isdir(folder) else 0} entries)"
                )
                raise NoCheckpointError(
                    f"resume_from_checkpoint=True: output_dir {folder} {what}; {fix}"
                )
            return found
        path = str(resume_from_checkpoint)
        if not os.path.isdir(path):
            what = "does not exist" if not os.path.exists(path) else "is a file, not a folder"
            raise NoCheckpointError(f"resume_from_checkpoint={path!r} {what}; {fix}")
        return path

    def _restore_engine(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, ENGINE_STATE_NAME)
        if not os.path.isfile(path):
            raise MissingPrivacyStateError(
                f"{checkpoint} has no {ENGINE_STATE_NAME}: the privacy ledger, noise and "
                "sampler state were not saved with it (it was not written by this DPTrainer "
                "version, or the file was removed). Resuming without them would report the "
                "epsilon of the resumed steps only. Resume from a checkpoint DPTrainer wrote, "
                "or start a new run."
            )
        state = load_checkpoint(path)
        self.privacy_engine.load_state_dict(state)
        self._resumed_loader_state = state.get("loader")
        if self.is_world_process_zero():  # fresh noise from here: a second one is a fork
            folder = os.path.dirname(os.path.abspath(checkpoint))
            self._resumed_from = folder
            found = self._engine_checkpoints(folder)
            at = int(os.path.basename(os.path.normpath(checkpoint)).rsplit("-", 1)[-1])
            self._continuation = claim_continuation(
                path, self.privacy_engine.steps_taken, self.privacy.allow_fork,
                at=at, reach=ckpt.reach(folder, found),
            )  # fmt: skip
        logger.info(
            "resumed privacy state from %s: %d steps, epsilon %.4f",
            path,
            self.privacy_engine.steps_taken,
            self.privacy_engine.epsilon(),
        )

    def _save_checkpoint(self, model, trial, *args: Any, **kwargs: Any) -> None:
        super()._save_checkpoint(model, trial, *args, **kwargs)
        if not self.is_world_process_zero():  # rank 0's state: its noise generator is the one
            return
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        final = os.path.join(folder, ENGINE_STATE_NAME)
        tmp = f"{final}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            torch.save(self.privacy_engine.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        # the run goes on from every older checkpoint (and may log or push their successors):
        # a later resume of one is a fork
        run_dir = self._get_output_dir(trial=trial)
        step = self.state.global_step
        ckpt.claim_superseded(self._engine_checkpoints(run_dir), step, f"superseded by {folder}")

    @staticmethod
    def _engine_checkpoints(run_dir: str) -> list[tuple[int, Path]]:
        """(global step, engine state file) of the run's checkpoint-N folders, oldest first."""
        found = []
        if os.path.isdir(run_dir):
            for name in os.listdir(run_dir):
                head, _, tail = name.rpartition("-")
                path = Path(run_dir, name, ENGINE_STATE_NAME)
                if head == PREFIX_CHECKPOINT_DIR and tail.isdigit() and path.is_file():
                    found.append((int(tail), path))
        return sorted(found)

    def _save_pooled_classifier(self, out: str) -> None:
        """dpfit's own classifier (dpfit.models.load_classifier) is no transformers model:
        Trainer saves its bare tensors, which nothing loads. Save it as `dpfit train` does, so
        ``load_classifier(out)`` and ``dpfit evaluate --model out`` read it."""
        from dpfit.tasks.pooling import PooledClassifier, save_pooled_classifier

        if not isinstance(self.model, PooledClassifier) or not self.is_world_process_zero():
            return
        tokenizer = getattr(self, "processing_class", None)
        if tokenizer is None:
            logger.warning(
                "DPTrainer.save_model: %s holds the classifier's tensors only; pass "
                "processing_class=tokenizer to DPTrainer to save a folder that "
                "dpfit.models.load_classifier and `dpfit evaluate` read",
                out,
            )
            return
        save_pooled_classifier(self.model, tokenizer, out)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        if self.is_world_process_zero():  # a release: claim the older checkpoints first
            run_dir = self.args.output_dir
            step = self.state.global_step
            ckpt.claim_superseded(self._engine_checkpoints(run_dir), step, "released: save_model")
            ckpt.record_release(run_dir, step, f"save_model({output_dir or run_dir})")
            if self._resumed_from is not None and self._resumed_from != os.path.abspath(run_dir):
                # a later fork of the checkpoint continued learns how far this one went
                ckpt.record_release(self._resumed_from, step, f"save_model({run_dir})")
        super().save_model(output_dir, _internal_call)
        out = output_dir or self.args.output_dir
        os.makedirs(out, exist_ok=True)
        self._save_pooled_classifier(out)
        record = {
            "private": True,
            "insecure_seed": self.privacy.insecure_seed is not None,
            "train_loss_logged": self.privacy.log_train_loss,
            "loss": f"per-example mean ({self._task})",
            **self.privacy_engine.privacy_record(),
        }
        if self.privacy.privacy_unit == "user":  # the engine's "document" is a user here
            record.update(privacy_unit="user", users=len(self.train_dataset))
        if self._continuation is not None:
            engine = self.privacy_engine
            record["continuation"] = fork_report(
                self._continuation, engine.ledger.records, engine.target_delta,
                engine.ledger.accountant,
            )  # fmt: skip
        with open(os.path.join(out, "dpfit.json"), "w") as f:
            json.dump(record, f, indent=2)

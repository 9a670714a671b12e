"""Make a transformers ``Trainer`` script private: swap ``Trainer`` for ``DPTrainer``.

    from dpfit.integrations import DPTrainer, PrivacyArguments
    trainer = DPTrainer(model=model, args=training_args, train_dataset=train_ds,
                        data_collator=collator, privacy=PrivacyArguments(target_epsilon=8))
    trainer.train()
    trainer.privacy_engine.epsilon()

What changes, and why:
* Batches come from the engine's Poisson loader (what the accountant assumes), not from
  Trainer's shuffled fixed-size loader. ``per_device_train_batch_size`` is the *expected*
  logical batch; each logical batch is one forward/backward (Trainer's loop fetches exactly
  one batch per update, so the engine's virtual steps cannot be used here).
* ``optimizer.step()`` becomes ``engine.step(optimizer)`` through a thin optimizer wrapper
  (clip per example, add noise, step, account); Trainer's own gradient clipping is turned off
  on a copy of the arguments, since clipping the summed gradient is not DP and would corrupt
  the engine's consistency check. Gradient accumulation > 1 is refused for the same reason.
* The loss is the model's own mean over the batch (Trainer's token-count rescaling is not a
  per-example-decomposable mean the engine can invert).
* Logs gain ``epsilon``; ``save_model`` also writes ``dpfit.json`` with the privacy record.
The user's model gets bias-only training (plus its new head) unless ``bias_only=False``; the
user's ``TrainingArguments`` object is not modified.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Trainer

from dpfit.engine import PrivacyEngine
from dpfit.errors import DPFitError
from dpfit.models import head_module_names
from dpfit.params import make_bias_trainable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrivacyArguments:
    """The privacy half of a DPTrainer's configuration."""

    target_epsilon: float | None = 8.0
    target_delta: float = 1e-5
    noise_multiplier: float | None = None  # overrides target_epsilon
    max_grad_norm: float = 1.0
    clipping: str = "flat"
    accountant: str = "rdp"
    bias_only: bool = True
    train_head: tuple[str, ...] | None = None  # None: the model's classification head, if any
    seed: int | None = None
    secure_rng: bool = False


class DPOptimizer(torch.optim.Optimizer):
    """Routes ``step()`` through ``engine.step(inner)``; everything else is the inner optimizer.

    It shares ``param_groups`` and ``state`` with the inner optimizer, so learning-rate
    schedulers built on it change the inner optimizer's learning rate.
    """

    def __init__(self, inner: torch.optim.Optimizer, engine: PrivacyEngine):  # noqa: D107
        # No super().__init__: it would re-register the parameters; share the inner state.
        self.inner = inner
        self.engine = engine
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
    """Trainer stops pulling after len() batches, leaving the Poisson pass undrained; finish
    it (it draws nothing more) before the next pass so each epoch gets its full round(1/q)."""

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


class DPTrainer(Trainer):
    """A ``Trainer`` whose training steps are DP-SGD steps of a dpfit ``PrivacyEngine``."""

    def __init__(self, *args: Any, privacy: PrivacyArguments | None = None, **kwargs: Any):
        self.privacy = privacy or PrivacyArguments()
        targs = kwargs.get("args") if "args" in kwargs else (args[1] if len(args) > 1 else None)
        if targs is None:
            raise DPFitError("DPTrainer needs TrainingArguments (args=...)")
        if targs.gradient_accumulation_steps != 1:
            raise DPFitError(
                "DPTrainer needs gradient_accumulation_steps=1: the Poisson logical batch is "
                "per_device_train_batch_size; accumulation would change what one noised step is"
            )
        targs = copy.copy(targs)
        targs.max_grad_norm = 0.0  # per-example clipping replaces Trainer's global clipping
        if "args" in kwargs:
            kwargs["args"] = targs
        else:
            args = (args[0], targs, *args[2:])
        model = kwargs.get("model") if "model" in kwargs else (args[0] if args else None)
        if model is None:
            raise DPFitError("DPTrainer needs a model (no model_init)")
        if self.privacy.bias_only:
            heads = self.privacy.train_head
            make_bias_trainable(
                model, train_head=head_module_names(model) if heads is None else heads
            )
        super().__init__(*args, **kwargs)
        if self.train_dataset is None:
            raise DPFitError("DPTrainer needs a train_dataset (its size sets the sampling rate)")
        self.privacy_engine = self._make_engine()

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
        return PrivacyEngine(
            self.model,
            expected_batch_size=min(a.per_device_train_batch_size, n),
            sample_size=n,
            target_delta=p.target_delta,
            max_grad_norm=p.max_grad_norm,
            clipping=p.clipping,
            accountant=p.accountant,
            seed=p.seed if p.seed is not None else a.seed,
            secure_rng=p.secure_rng,
            loss_reduction="mean",
            **kwargs,
        )

    def get_train_dataloader(self):
        dataset = self.train_dataset
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset) and self.args.remove_unused_columns:
                dataset = self._remove_unused_columns(dataset, description="training")
        except ImportError:  # pragma: no cover
            pass
        # one physical batch per logical batch: Trainer fetches one batch per update
        return _PassLoader(self.privacy_engine.data_loader(dataset, collate_fn=self.data_collator))

    def create_optimizer(self, model=None):
        opt = super().create_optimizer(model) if model is not None else super().create_optimizer()
        if not isinstance(opt, DPOptimizer):
            self.optimizer = DPOptimizer(opt, self.privacy_engine)
        return self.optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        engine = getattr(self, "privacy_engine", None)
        if engine is not None and engine.steps_taken and "loss" in logs:
            logs = {**logs, "epsilon": engine.epsilon(), "dp_steps": engine.steps_taken}
        super().log(logs, *args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        super().save_model(output_dir, _internal_call)
        out = output_dir or self.args.output_dir
        os.makedirs(out, exist_ok=True)
        record = {"private": True, **self.privacy_engine.privacy_record()}
        with open(os.path.join(out, "dpfit.json"), "w") as f:
            json.dump(record, f, indent=2)

"""Shared pieces of the DPTrainer tests: plain-SGD training arguments that change nothing
between steps but the update, and the trainable parameters as one vector."""

from __future__ import annotations

import torch


def sgd_training_args(tmp_path, **kw):
    """TrainingArguments for a few SGD steps at a constant rate, on the CPU, saving nothing."""
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path / "out"), optim="sgd", lr_scheduler_type="constant",
                weight_decay=0.0, report_to=[], use_cpu=True, logging_steps=1,
                save_strategy="no", seed=0, disable_tqdm=True)  # fmt: skip
    return TrainingArguments(**{**base, **kw})


def trainable(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])

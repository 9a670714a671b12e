"""Shared pieces of the DPTrainer tests: plain-SGD training arguments that change nothing
between steps but the update, the trainable parameters as one vector, and a callback that
stops a run after a given step (a run interrupted after its checkpoint)."""

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


def stop_at(step: int):
    """A TrainerCallback that stops training after `step` (after that step's checkpoint)."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == step:
                control.should_training_stop = True

    return StopAt()

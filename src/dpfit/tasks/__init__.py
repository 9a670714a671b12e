"""Task plug-ins for the one training loop in :mod:`dpfit.train`.

A task says how to read its data and build its model (with its head), how to encode and batch
examples, the loss (a mean of per-example losses, as DP-SGD's per-example clipping needs), how
to score the trained model and how to save it. The loop, the privacy engine, checkpoints and
reporting are the same for every task.
"""

from __future__ import annotations

from collections.abc import Callable

from dpfit.tasks.base import Prepared, Task

__all__ = ["Prepared", "Task", "get_task"]


def get_task(name: str) -> Task:
    """The registered task plug-in called `name`."""
    from dpfit.tasks.causal_lm import CausalLMTask
    from dpfit.tasks.classification import ClassificationTask
    from dpfit.tasks.image_classification import ImageClassificationTask

    tasks: dict[str, Callable[[], Task]] = {
        "classification": ClassificationTask,
        "causal-lm": CausalLMTask,
        "image-classification": ImageClassificationTask,
    }
    if name not in tasks:
        raise ValueError(f"task must be one of {sorted(tasks)}, got {name!r}")
    return tasks[name]()

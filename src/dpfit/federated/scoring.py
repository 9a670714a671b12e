"""The server's score of a parameter list: (loss, accuracy) on its public validation or test
split. Below the app, the CLI and the output writer, which all score released models."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from dpfit.federated.client import evaluate, task_model
from dpfit.federated.examples import eval_split

if TYPE_CHECKING:
    from dpfit.federated.task_config import TaskConfig


def make_evaluate_fn(
    task: TaskConfig, which: str = "validation"
) -> Callable[..., tuple[float, float]]:
    """Server-side (loss, accuracy) of a parameter list on the validation or test split."""
    texts, labels = eval_split(task, which)

    def fn(params: Sequence[np.ndarray]) -> tuple[float, float]:
        lm = task_model(task)
        lm.set_arrays(params)
        return evaluate(lm, texts, labels, task.max_length)

    return fn

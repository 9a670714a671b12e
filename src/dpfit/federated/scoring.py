"""The server's score of a parameter list: (loss, accuracy) on its public validation or test
split. Below the app, the CLI and the output writer, which all score released models."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from dpfit.federated.client import evaluate, local_train, task_model
from dpfit.federated.examples import eval_split
from dpfit.federated.public_trial import TrialFn, make_trial_fn, pseudo_rngs

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


def make_trial_fn_for_task(task: TaskConfig) -> TrialFn:
    """The server's public trial (``--method public-trial``) on the per-client engines:
    pseudo-clients trained one after another by the clients' own ``local_train``."""
    lm = task_model(task)

    def train(start, data):
        rngs = pseudo_rngs(task.seed, len(data))
        return [
            local_train(lm, start, [e.text for e in d], [e.label for e in d], task, r)[0]
            for d, r in zip(data, rngs, strict=True)
        ]

    def scorer(texts, labels):
        def fn(params):
            lm.set_arrays(params)
            return evaluate(lm, texts, labels, task.max_length)

        return fn

    return make_trial_fn(train, scorer, *eval_split(task, "validation"), task.seed)

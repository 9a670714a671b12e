"""The examples each party holds: one client's (capped) training rows, and the split the
server scores on, from the bundled data (``bundled``) or a user's file (``data``).

Below the ClientApp, the batched engine and the app, which all read a client's data here.
The bundled splits are looked up on ``bundled`` at each call (one place to swap them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dpfit.data.bundled import TextExample
from dpfit.federated import bundled
from dpfit.federated.data import (
    PartitionError,
    client_cap,
    client_partition,
    server_splits,
    subsample,
)

if TYPE_CHECKING:
    from dpfit.federated.task_config import TaskConfig


def client_examples(task: TaskConfig, partition_id: int) -> list[TextExample]:
    """The (capped) local data of one client, from the bundled data or the user's file."""
    if not 0 <= partition_id < task.num_clients:
        raise PartitionError(f"partition id {partition_id} outside [0, {task.num_clients})")
    if task.data:
        part = client_partition(task)
        train, idx = part.train, part.clients[partition_id]
    else:
        train = bundled.splits(task.seed)[0]
        idx = bundled.partitions(task.num_clients, task.partition, task.alpha, task.seed)[
            partition_id
        ]
    examples = [train[i] for i in idx]
    return client_cap(examples, task.examples_per_client, task.seed)


def eval_split(task: TaskConfig, which: str = "validation") -> tuple[list[str], list[int]]:
    """(texts, labels) the server scores on: its public validation or test split, capped."""
    if task.data:
        val, test = (list(x) for x in server_splits(task))
    else:
        _, val, test = bundled.splits(task.seed)
    data = subsample(val if which == "validation" else test, task.eval_examples, task.seed + 1)
    return [e.text for e in data], [e.label for e in data]

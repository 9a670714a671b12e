"""Which examples each client holds, and what the server scores on: one path for any data.

A federation is the pooled training rows, each client's row indices, and the server's public
validation and test sets. The bundled Rotten Tomatoes data (``bundled.splits``) and a user's
CSV / JSONL / saved ``datasets`` folder, read by ``dpfit train``'s loader
(``dpfit.data.text``), are two sources of it; both are cut into clients by
``partition_rows`` (flwr-datasets partitioners):

- natural clients: each distinct value of a client column is one client (the bundled
  ``movie`` partition is this, with movies hashed onto N clients);
- ``iid``: each row's client from a keyed hash of the row (text and label) and ``--seed``,
  uniform over the N clients (sizes vary binomially around rows / N);
- ``dirichlet``: label skew: each label's spread over the clients drawn from Dirichlet(alpha)
  with ``--seed``, and each row placed by its own keyed hash against its label's spread.

A row's synthetic client depends on that row alone (``dpfit.data.rowhash``): adding or
removing one row changes one client by that row, never the others.

A synthetic partition is setup, not private output: it comes from ``--seed`` (public
randomness, like the data split), and the protected unit is then one synthetic client.

Label names of a user's file follow ``dpfit train``'s rule (``dpfit.tasks.labels``): given
with ``--labels``, or read from the data and each carried by enough clients (the privacy
unit: a client with many rows of a name counts once), or declared public.
"""

from __future__ import annotations

import contextlib
import functools
import io
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from dpfit.data.bundled import ROTTEN_TOMATOES_LABELS, TextExample
from dpfit.data.rowhash import CLIENT, CLIENT_CAP, row_keys, smallest, text_row
from dpfit.data.text import DataError, LabeledTexts, load_grouped_texts, load_texts
from dpfit.tasks.labels import parse_labels

if TYPE_CHECKING:
    from dpfit.federated.task_config import TaskConfig

BUNDLED_LABELS = ROTTEN_TOMATOES_LABELS  # the bundled task's classes, label 0 / 1
# user data: natural clients from a column, or a synthetic partition of the rows
USER_PARTITIONS = ("column", "iid", "dirichlet")
MIN_EVAL_EXAMPLES = 2  # the server's set is halved into validation and test

T = TypeVar("T")


class PartitionError(DataError):
    """The requested partition cannot be built from the data."""


def subsample(items: list[T], k: int, seed: int) -> list[T]:
    """At most ``k`` of ``items`` (all when k <= 0), a seeded choice kept in order."""
    if k <= 0 or len(items) <= k:
        return items
    idx = np.random.default_rng(seed).choice(len(items), size=k, replace=False)
    return [items[i] for i in sorted(idx)]


def client_cap(examples: Sequence[TextExample], k: int, seed: int) -> list[TextExample]:
    """At most ``k`` of one client's examples (all when k <= 0; ``--examples-per-client``),
    those with the smallest keyed hash of their own content, kept in order. A client's capped
    rows then depend on its rows alone: a seed per client position would change every later
    client's rows when a new client (a new --client-column value) sorts before them."""
    if k <= 0 or len(examples) <= k:
        return list(examples)
    keys = row_keys((text_row(e.text, str(e.label)) for e in examples), seed, CLIENT_CAP)
    return [examples[i] for i in sorted(smallest(keys, k).tolist())]


def partition_rows(
    labels: Sequence[int],
    num_clients: int,
    partition: str,
    alpha: float,
    seed: int,
    natural_ids: Sequence[str] | Sequence[int] | None = None,
    keys: Sequence[float] | np.ndarray | None = None,
    num_labels: int | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Row indices of each client.

    ``partition``: ``iid`` or ``dirichlet`` (:func:`hashed_clients`: each row's client from
    its own key in [0, 1), ``keys``, e.g. :func:`client_keys`) or ``natural`` (one client per
    distinct value of ``natural_ids``, in sorted order: client i holds the i-th value's rows;
    flwr-datasets' NaturalIdPartitioner).
    """
    if partition in ("iid", "dirichlet"):
        if keys is None or len(keys) != len(labels):
            raise PartitionError(f"an {partition} partition needs one row key per row")
        return hashed_clients(labels, keys, num_clients, partition, alpha, seed, num_labels)
    import datasets
    from flwr_datasets.partitioner import NaturalIdPartitioner

    data: dict[str, list] = {"idx": list(range(len(labels))), "label": list(labels)}
    if partition == "natural":
        if natural_ids is None or len(natural_ids) != len(labels):
            raise PartitionError("a natural partition needs one client id per row")
        data["client"] = list(natural_ids)
        part = NaturalIdPartitioner(partition_by="client")
    else:
        raise PartitionError(f"unknown partition {partition!r}")
    part.dataset = datasets.Dataset.from_dict(data)
    if partition == "natural":
        found = len(set(natural_ids or ()))
        if found < num_clients:
            raise PartitionError(f"only {found} natural clients for {num_clients} requested")
    # NaturalIdPartitioner draws a tqdm bar on stderr, which is the operator's log
    with contextlib.redirect_stderr(io.StringIO()):
        out = [part.load_partition(i) for i in range(num_clients)]
    return tuple(tuple(int(x) for x in p["idx"]) for p in out)


MIN_DIRICHLET_ROWS = 2  # rows a Dirichlet client must hold (flwr-datasets' default minimum)


def client_keys(rows: Sequence[TextExample], names: Sequence[str], seed: int) -> np.ndarray:
    """Each row's key in [0, 1) for its synthetic client: a keyed hash of its text and label
    name (dpfit.data.rowhash), so the row's client depends on that row alone."""
    return row_keys((text_row(e.text, names[e.label]) for e in rows), seed, CLIENT)


def hashed_clients(
    labels: Sequence[int],
    keys: Sequence[float] | np.ndarray,
    num_clients: int,
    partition: str,
    alpha: float,
    seed: int,
    num_labels: int | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Row indices of each client, every row placed by its own key alone.

    ``iid``: client floor(key * N). ``dirichlet``: label y's spread over the N clients is
    drawn from Dirichlet(alpha) with ``seed`` (public: it depends on the seed, N, alpha and
    the number of labels, not on the rows), and a row of label y goes to the client whose
    interval of that spread holds its key. Adding or removing a row changes one client by
    that row. A client left with too few rows is an error that says what to change.
    """
    keys = np.asarray(keys, dtype=np.float64)
    ys = np.asarray(labels, dtype=np.int64)
    if partition == "iid":
        owner = np.minimum((keys * num_clients).astype(np.int64), num_clients - 1)
        least, fix = 1, "fewer --clients (or a larger --examples-per-client)"
    elif partition == "dirichlet":
        k = num_labels if num_labels is not None else int(ys.max(initial=-1)) + 1
        spread = np.random.default_rng(seed).dirichlet([alpha] * num_clients, size=max(k, 1))
        edges = np.cumsum(spread, axis=1)
        owner = np.array(
            [np.searchsorted(edges[y], u, side="right") for y, u in zip(ys, keys, strict=True)],
            dtype=np.int64,
        )
        owner = np.minimum(owner, num_clients - 1)
        least, fix = MIN_DIRICHLET_ROWS, "fewer clients, a larger --alpha, or --partition iid"
    else:
        raise PartitionError(f"unknown partition {partition!r}")
    sizes = np.bincount(owner, minlength=num_clients)
    if sizes.min() < least:
        raise PartitionError(
            f"{partition} over {num_clients} clients leaves {int((sizes < least).sum())} "
            f"client(s) with fewer than {least} of the {len(ys)} training examples (each "
            f"row's client comes from a hash of the row and --seed). Use {fix}."
        )
    return tuple(tuple(int(i) for i in np.flatnonzero(owner == c)) for c in range(num_clients))


# --------------------------------------------------------------------------------------------
# A user's own file
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Clients:
    """A user's training rows as clients: the rows, each client's row indices, the classes."""

    train: tuple[TextExample, ...]
    clients: tuple[tuple[int, ...], ...]
    label_names: tuple[str, ...]
    label_note: str  # where the label names come from and why they may be published


@dataclass(frozen=True)
class Federation:
    """What the server checks before a run on a user's data: the clients and its splits."""

    clients: Clients
    validation: tuple[TextExample, ...]
    test: tuple[TextExample, ...]


@functools.lru_cache(maxsize=4)
def user_rows(
    data: str, text_column: str, label_column: str, labels: str, client_column: str
) -> tuple[LabeledTexts, tuple[str, ...]]:
    """The rows of a user's file, read by ``dpfit train``'s loader, and with a client column
    each row's client value."""
    names = parse_labels(labels)
    ids = names is not None  # number k in the file: the k-th --labels name, as in train
    if client_column:
        return load_grouped_texts(
            data, client_column, text_column, label_column, names, label_ids=ids
        )
    return load_texts(data, text_column, label_column, names, label_ids=ids), ()


def _rows(task: TaskConfig) -> tuple[LabeledTexts, tuple[str, ...]]:
    return user_rows(
        task.data, task.text_column, task.label_column, task.labels, task.client_column
    )


def label_names(task: TaskConfig) -> tuple[str, ...]:
    """The classes of the task's model head, in id order: the bundled task's, ``--labels``,
    or the names in the user's file (``client_partition`` checks they may be published)."""
    return _rows(task)[0].label_names if task.data else BUNDLED_LABELS


def client_ids(rows: Sequence[TextExample]) -> list[str] | list[int]:
    """Each row's client value, as the partitioner sorts them (client i = the i-th value):
    numbers in numeric order when every value is an integer, else text in sorted order."""
    groups = [e.group for e in rows]
    if all(re.fullmatch(r"-?(0|[1-9]\d*)", g) for g in groups):  # int(g) one-to-one
        return [int(g) for g in groups]
    return groups


def user_row_count(task: TaskConfig) -> int:
    """How many usable rows the user's file has (n, public by declaration as in train)."""
    return len(_rows(task)[0])


def natural_client_count(task: TaskConfig) -> int:
    """N of a client column: its number of distinct values (public by declaration)."""
    return len(set(_rows(task)[1]))


def client_partition(task: TaskConfig) -> Clients:
    """The user's rows cut into the task's clients, label names checked (cached)."""
    return _client_partition(
        task.data,
        task.text_column,
        task.label_column,
        task.labels,
        task.public_labels,
        task.client_column,
        task.partition,
        task.alpha,
        task.num_clients,
        task.examples_per_client,
        task.seed,
    )


def federation(task: TaskConfig) -> Federation:
    """The clients and the server's validation / test sets: every data error, up front."""
    return Federation(client_partition(task), *server_splits(task))


@functools.lru_cache(maxsize=4)
def _client_partition(
    data: str,
    text_column: str,
    label_column: str,
    labels: str,
    public_labels: bool,
    client_column: str,
    partition: str,
    alpha: float,
    num_clients: int,
    examples_per_client: int,
    seed: int,
) -> Clients:
    rows, groups = user_rows(data, text_column, label_column, labels, client_column)
    # file order: a synthetic client comes from each row's own hash (hashed_clients), so a
    # file sorted by label or by client still gives IID clients, and no other row's client
    # (nor its place in its client's list) depends on where a row sits
    train = tuple(
        TextExample(rows.texts[i], rows.labels[i], groups[i] if groups else "")
        for i in range(len(rows))
    )
    ys = [e.label for e in train]
    if partition == "column":
        found = len(set(groups))
        if found < 2:
            raise PartitionError(
                f"{data}: column {client_column!r} holds a single client; federated training "
                "needs at least 2 (use another --client-column, or drop it and cut the rows "
                "into synthetic clients with --partition iid|dirichlet)"
            )
        if found != num_clients:
            raise PartitionError(
                f"{data}: column {client_column!r} holds {found} clients, not "
                f"num_clients={num_clients}; leave --clients out with --client-column"
            )
        clients = partition_rows(ys, found, "natural", alpha, seed, natural_ids=client_ids(train))
    elif partition in ("iid", "dirichlet"):
        if len(train) < num_clients:
            raise PartitionError(
                f"{data}: {len(train)} rows cannot make {num_clients} clients; pass fewer "
                "--clients or a smaller --examples-per-client"
            )
        keys = client_keys(train, rows.label_names, seed)
        clients = partition_rows(
            ys, num_clients, partition, alpha, seed, keys=keys, num_labels=rows.num_labels
        )
    else:
        raise PartitionError(
            f"partition {partition!r} is not one for a user's file: use --client-column COL, "
            f"or --partition iid|dirichlet"
        )
    names = rows.label_names
    note = _label_note(
        data, names, train, clients, labels, public_labels, examples_per_client, seed
    )
    return Clients(train, clients, names, note)


def _label_note(
    data: str,
    names: tuple[str, ...],
    train: Sequence[TextExample],
    clients: Sequence[Sequence[int]],
    labels: str,
    public_labels: bool,
    examples_per_client: int,
    seed: int,
) -> str:
    """dpfit train's label gate, on the rows that train (every client's capped rows), counting
    the privacy unit: the number of distinct clients whose rows carry each name. A client
    holding many rows of a name is one unit, so it counts once."""
    from dpfit.tasks.labels import LabelUnits, check_data_label_names

    if parse_labels(labels) is not None:
        return f"label names (public, from --labels): {', '.join(names)}"
    row_labels: list[str] = []
    row_clients: list[int] = []
    for pid, idx in enumerate(clients):
        for e in client_cap([train[i] for i in idx], examples_per_client, seed):
            row_labels.append(names[e.label])
            row_clients.append(pid)
    units = LabelUnits.count(row_labels, row_clients, "clients")
    return check_data_label_names(names, units, data, public_labels, "metrics.json (label_names)")


def server_splits(task: TaskConfig) -> tuple[tuple[TextExample, ...], tuple[TextExample, ...]]:
    """The server's public set (``eval_data``), halved with the seed into validation (scored
    every round, read by the clip rules) and test (scored once, at the end)."""
    ids = parse_labels(task.labels) is not None  # number k: the k-th --labels name
    return _server_splits(
        task.eval_data, task.text_column, task.label_column, label_names(task), ids, task.seed
    )


@functools.lru_cache(maxsize=4)
def _server_splits(
    eval_data: str,
    text_column: str,
    label_column: str,
    names: tuple[str, ...],
    label_ids: bool,
    seed: int,
) -> tuple[tuple[TextExample, ...], tuple[TextExample, ...]]:
    if not eval_data:
        raise DataError(
            "a user's federated data needs --eval-data FILE, the server's public validation "
            "and test set (the clients' rows are private: the server cannot score on them)"
        )
    held = load_texts(eval_data, text_column, label_column, label_names=names, label_ids=label_ids)
    if len(held) < MIN_EVAL_EXAMPLES:
        raise DataError(
            f"{eval_data} has {len(held)} usable row(s); the server halves it into validation "
            f"and test, so give at least {MIN_EVAL_EXAMPLES}"
        )
    # the server's set is public: a seeded shuffle of positions halves it exactly (no row's
    # privacy is at stake, so no per-row rule is needed, and neither half is ever empty)
    order = list(range(len(held)))
    random.Random(seed).shuffle(order)
    cut = max(1, round(0.5 * len(held)))
    val, test = sorted(order[cut:]), sorted(order[:cut])

    def examples(idx: list[int]) -> tuple[TextExample, ...]:
        return tuple(TextExample(held.texts[i], held.labels[i]) for i in idx)

    return examples(val), examples(test)

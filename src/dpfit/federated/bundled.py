"""The bundled federation: Rotten Tomatoes split by movie, its training split cut into clients.

The server holds the validation and test splits as public data; the clients' rows come from
the training split, by the same partitioners as a user's file (``data.partition_rows``): IID
or Dirichlet label skew by each row's keyed hash, or natural clients by movie.
"""

from __future__ import annotations

import functools
import hashlib

from dpfit.data.bundled import TextExample, rotten_tomatoes, split_by_group
from dpfit.federated.data import BUNDLED_LABELS, PartitionError, client_keys, partition_rows

PARTITIONS = ("iid", "dirichlet", "movie")  # of the bundled data


@functools.lru_cache(maxsize=4)
def splits(seed: int) -> tuple[list[TextExample], list[TextExample], list[TextExample]]:
    """(train, validation, test) split by movie; the server holds validation as public data."""
    train, val, test = split_by_group(rotten_tomatoes(), (0.8, 0.1, 0.1), seed)
    return train, val, test


@functools.lru_cache(maxsize=4)
def partitions(
    num_clients: int, partition: str, alpha: float, seed: int
) -> tuple[tuple[int, ...], ...]:
    """Indices into the bundled training split for each client (``data.partition_rows``)."""
    if partition not in PARTITIONS:
        raise PartitionError(f"partition must be one of {PARTITIONS}, got {partition!r}")
    train = splits(seed)[0]
    # natural clients: each movie belongs to one client (movies hashed onto N clients)
    movie_client = [
        int(hashlib.sha256(f"{seed}:{e.group}".encode()).hexdigest(), 16) % num_clients
        for e in train
    ]
    try:
        return partition_rows(
            [e.label for e in train],
            num_clients,
            "natural" if partition == "movie" else partition,
            alpha,
            seed,
            natural_ids=movie_client if partition == "movie" else None,
            keys=client_keys(train, BUNDLED_LABELS, seed) if partition != "movie" else None,
            num_labels=len(BUNDLED_LABELS),
        )
    except PartitionError as exc:
        raise PartitionError(str(exc).replace("natural clients", "movie clients")) from None

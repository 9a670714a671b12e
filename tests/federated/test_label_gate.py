"""The public-label gate of a user's federated data counts clients (the privacy unit), not
rows: one client holding 25 rows of a name is one unit, and its name must not be published
in metrics.json or the head's class list. Fast: the partition only, no model."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from dpfit.federated.client import TaskConfig
from dpfit.federated.data import client_partition
from dpfit.tasks.labels import MIN_PUBLIC_LABEL_COUNT, RareLabelError

K = MIN_PUBLIC_LABEL_COUNT
RARE = "alice-hiv-positive"


def _write(path: Path, rows: list[tuple[str, str, str]]) -> str:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["user", "text", "label"])
        w.writerows(rows)
    return str(path)


def _common(clients: int) -> list[tuple[str, str, str]]:
    """`clients` clients, each with one neg and one pos row: both names carried by all."""
    return [(f"u{c:03d}", f"text {c} {y}", y) for c in range(clients) for y in ("neg", "pos")]


def _task(data: str, clients: int, **kw) -> TaskConfig:
    return TaskConfig(
        data=data, eval_data=data, client_column="user", partition="column",
        num_clients=clients, examples_per_client=0, **kw,
    )  # fmt: skip


def test_one_client_with_many_rows_of_a_name_is_refused(tmp_path):
    rows = _common(K + 5) + [("alice", f"alice's row {i}", RARE) for i in range(K + 5)]
    data = _write(tmp_path / "d.csv", rows)
    with pytest.raises(RareLabelError, match=rf"{RARE}.*--labels") as e:
        client_partition(_task(data, K + 6))
    assert f"fewer than {K} clients" in str(e.value)
    # declared public, or given with --labels, the run may go ahead
    assert RARE in client_partition(_task(data, K + 6, public_labels=True)).label_names
    given = client_partition(_task(data, K + 6, labels=f"neg,pos,{RARE}"))
    assert given.label_note.startswith("label names (public, from --labels)")


def test_a_name_carried_by_enough_clients_passes(tmp_path):
    rows = _common(K) + [(f"u{c:03d}", f"{RARE} {c}", RARE) for c in range(K)]
    part = client_partition(_task(_write(tmp_path / "d.csv", rows), K))
    assert part.label_names == (RARE, "neg", "pos")
    assert f"each carried by >= {K} clients" in part.label_note
    # one client fewer carries it: refused, though K - 1 clients still hold 2 rows each
    fewer = _common(K) + [
        (f"u{c:03d}", f"{RARE} {c} {j}", RARE) for c in range(K - 1) for j in (0, 1)
    ]
    with pytest.raises(RareLabelError, match=RARE):
        client_partition(_task(_write(tmp_path / "e.csv", fewer), K))


def test_synthetic_clients_are_the_unit_too(tmp_path):
    """--partition iid: the protected unit is one synthetic client, so names are counted per
    client; with fewer than 20 clients no name read from the data can pass."""
    rows = [("", f"text {i}", ("neg", "pos")[i % 2]) for i in range(200)]
    data = _write(tmp_path / "d.csv", rows)
    task = TaskConfig(data=data, eval_data=data, partition="iid", num_clients=10)
    with pytest.raises(RareLabelError, match="fewer than 20 clients"):
        client_partition(task)

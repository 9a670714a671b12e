"""Synthetic clients keep neighbours neighbours: one row added to or removed from a user's
file changes one client by that row, and no other client (nor its capped rows)."""

from __future__ import annotations

import csv
from collections import Counter

import numpy as np
import pytest

from dpfit.federated import data as fed_data
from dpfit.federated.app import client_examples
from dpfit.federated.client import TaskConfig
from dpfit.federated.data import PartitionError, client_partition, hashed_clients


def _write(path, rows) -> str:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("text", "label"))
        w.writerows(rows)
    return str(path)


def _rows(n: int) -> list[tuple[str, str]]:
    return [(f"text {i}", ("neg", "pos")[i % 2]) for i in range(n)]


def _clients(task: TaskConfig) -> list[Counter]:
    fed_data.user_rows.cache_clear()
    fed_data._client_partition.cache_clear()
    return [
        Counter((e.text, e.label) for e in client_examples(task, i))
        for i in range(task.num_clients)
    ]


def _changed(a: list[Counter], b: list[Counter]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
@pytest.mark.parametrize("cap", [0, 10])
def test_one_row_added_or_removed_changes_one_client_only(tmp_path, partition, cap):
    base = _rows(400)
    files = {
        "base": _write(tmp_path / "a.csv", base),
        "added": _write(tmp_path / "b.csv", [("a new row", "pos"), *base]),  # at the top
        "removed": _write(tmp_path / "c.csv", base[:150] + base[151:]),
    }
    tasks = {
        k: TaskConfig(data=f, eval_data=f, partition=partition, num_clients=4, alpha=1.0,
                      examples_per_client=cap, labels="neg,pos")
        for k, f in files.items()
    }  # fmt: skip
    clients = {k: _clients(t) for k, t in tasks.items()}
    for other, row in (("added", ("a new row", 1)), ("removed", ("text 150", 0))):
        changed = _changed(clients["base"], clients[other])
        assert len(changed) <= 1, (other, changed)
        if not cap:  # uncapped: exactly that row, in exactly one client
            (i,) = changed
            a, b = clients["base"][i], clients[other][i]
            assert (b - a) + (a - b) == Counter({row: 1})


def test_partition_is_seeded_complete_and_iid_balanced(tmp_path):
    f = _write(tmp_path / "d.csv", _rows(4000))
    task = TaskConfig(data=f, eval_data=f, partition="iid", num_clients=4, labels="neg,pos")
    part = client_partition(task)
    sizes = [len(c) for c in part.clients]
    assert sorted(i for c in part.clients for i in c) == list(range(4000))
    assert all(abs(s - 1000) < 150 for s in sizes)
    assert client_partition(task).clients == part.clients
    other = client_partition(TaskConfig(**{**vars(task), "seed": 1}))
    assert other.clients != part.clients


def test_dirichlet_skews_labels_and_empty_clients_are_refused():
    labels = [i % 2 for i in range(2000)]
    keys = np.random.default_rng(0).random(2000)
    clients = hashed_clients(labels, keys, 5, "dirichlet", 0.1, seed=0, num_labels=2)
    mix = [np.mean([labels[i] for i in c]) for c in clients if len(c) >= 20]
    assert max(abs(m - 0.5) for m in mix) > 0.3  # far from the pooled 50/50
    with pytest.raises(PartitionError, match="fewer than 1"):
        hashed_clients(labels[:5], keys[:5], 50, "iid", 0.1, seed=0)


def test_a_new_client_column_value_leaves_every_other_clients_capped_rows(tmp_path):
    """--client-column: a new client whose id sorts first shifts every other client's position;
    their capped rows (--examples-per-client) must not move with it (the cap is chosen by each
    row's own keyed hash, not by a seed per position)."""

    def write(path, rows):
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(("text", "label", "who"))
            w.writerows(rows)
        return str(path)

    base = [
        (f"text {c}-{i}", ("neg", "pos")[i % 2], f"client-{c}") for c in range(6) for i in range(9)
    ]
    added = [*base, *((f"new {i}", "pos", "aaa-first") for i in range(9))]

    def capped(path: str) -> dict[str, Counter]:
        task = TaskConfig(data=path, eval_data=path, partition="column", client_column="who",
                          num_clients=len({r[2] for r in (added if "b." in path else base)}),
                          examples_per_client=4, labels="neg,pos")  # fmt: skip
        fed_data.user_rows.cache_clear()
        fed_data._client_partition.cache_clear()
        out = {}
        for pid in range(task.num_clients):
            ex = client_examples(task, pid)
            who = {
                e.text.split()[1].split("-")[0] if e.text.startswith("text") else "new" for e in ex
            }
            out[who.pop()] = Counter((e.text, e.label) for e in ex)
        return out

    a, b = capped(write(tmp_path / "a.csv", base)), capped(write(tmp_path / "b.csv", added))
    assert set(b) == set(a) | {"new"}
    assert all(b[c] == a[c] and sum(a[c].values()) == 4 for c in a)

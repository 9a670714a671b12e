"""A SuperNode's partition comes from its node config, never from its node id:
``node_id % N`` puts one partition on several nodes, so that partition could send
several clipped updates in one round and be sampled more often than q."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dpfit.federated.app import PartitionError
from dpfit.federated.client import TaskConfig, _partition_id

TASK = TaskConfig(num_clients=20)


def _context(node_id: int, **node_config) -> SimpleNamespace:
    return SimpleNamespace(node_id=node_id, node_config=node_config)


@pytest.mark.parametrize("node_id", [7, 1027, 6_148_914_691_236_517_205])
def test_supernode_without_partition_id_is_refused(node_id):
    with pytest.raises(PartitionError, match="partition-id=<i> num-partitions=20"):
        _partition_id(_context(node_id), TASK)


def test_explicit_partition_is_used_whatever_the_node_id():
    assert _partition_id(_context(1027, **{"partition-id": 3, "num-partitions": 20}), TASK) == 3
    assert _partition_id(_context(7, **{"partition-id": "19"}), TASK) == 19


def test_partition_count_other_than_the_runs_is_refused():
    with pytest.raises(PartitionError, match="num-partitions=20"):
        _partition_id(_context(1, **{"partition-id": 3, "num-partitions": 10}), TASK)

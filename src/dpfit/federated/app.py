"""The Flower app: data partitions, the ServerApp, and the ways to run it.

- ``run_simulation``: Flower's simulation engine (Ray), N virtual SuperNodes.
- ``run_local``: the same ClientApp and Strategy over ``LocalGrid``, an in-process Grid that
  calls the ClientApp directly: no Ray, for tests and benchmarks on small machines.
- ``server_app`` / ``client_app``: the components ``flwr run`` loads on a real deployment
  (the shipped ``flwr_app/pyproject.toml`` names them, see ``deploy``); the run config
  carries the settings.

Clients' data: the bundled Rotten Tomatoes data (IID, Dirichlet label skew, or natural
clients by movie) or a user's own file (``TaskConfig.data``; ``dpfit.federated.data``), cut
into clients by the same flwr-datasets partitioners (``data.partition_rows``).
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from typing import Any
from uuid import uuid4

import numpy as np

from dpfit.data.bundled import TextExample, rotten_tomatoes, split_by_group
from dpfit.federated.client import TaskConfig, build_client_app, evaluate, task_model
from dpfit.federated.data import (  # noqa: F401 - PartitionError re-exported
    BUNDLED_LABELS,
    PartitionError,
    client_cap_seed,
    client_keys,
    client_partition,
    federation,
    partition_rows,
    server_splits,
    subsample,
)
from dpfit.federated.strategy import DPFedAvg, DPFedAvgServer, RoundRecord, ServerConfig

logger = logging.getLogger(__name__)

PARTITIONS = ("iid", "dirichlet", "movie")  # of the bundled data


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def splits(seed: int) -> tuple[list[TextExample], list[TextExample], list[TextExample]]:
    """(train, validation, test) split by movie; the server holds validation as public data."""
    train, val, test = split_by_group(rotten_tomatoes(), (0.8, 0.1, 0.1), seed)
    return train, val, test


_subsample = subsample  # the name the benchmarks use


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


def client_examples(task: TaskConfig, partition_id: int) -> list[TextExample]:
    """The (capped) local data of one client, from the bundled data or the user's file."""
    if not 0 <= partition_id < task.num_clients:
        raise PartitionError(f"partition id {partition_id} outside [0, {task.num_clients})")
    if task.data:
        part = client_partition(task)
        train, idx = part.train, part.clients[partition_id]
    else:
        train = splits(task.seed)[0]
        idx = partitions(task.num_clients, task.partition, task.alpha, task.seed)[partition_id]
    examples = [train[i] for i in idx]
    return _subsample(examples, task.examples_per_client, client_cap_seed(task.seed, partition_id))


def eval_split(task: TaskConfig, which: str = "validation") -> tuple[list[str], list[int]]:
    """(texts, labels) the server scores on: its public validation or test split, capped."""
    if task.data:
        val, test = (list(x) for x in server_splits(task))
    else:
        _, val, test = splits(task.seed)
    data = _subsample(val if which == "validation" else test, task.eval_examples, task.seed + 1)
    return [e.text for e in data], [e.label for e in data]


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


def initial_arrays(task: TaskConfig) -> list[np.ndarray]:
    """The trainables as loaded (the cached model's live values change during a run)."""
    lm = task_model(task)
    return [a.copy() for a in lm.initial]


# --------------------------------------------------------------------------------------------
# In-process Grid
# --------------------------------------------------------------------------------------------

ClientFn = Callable[[Any, Any], Any]


class LocalGrid:
    """A Flower Grid that delivers each message by calling a ClientApp in this process.

    ``clients`` maps node id -> callable(message, context); a client that raises produces an
    error reply, one that returns None never answers (a timeout).
    """

    def __init__(self, clients: dict[int, ClientFn], node_configs: dict[int, dict[str, Any]]):
        from flwr.common.constant import SUPERLINK_NODE_ID
        from flwr.supercore.task_identity import TaskIdentity

        # Messages read the process's task identity; Flower's own runtimes set it the same way.
        TaskIdentity.task_id = 1
        TaskIdentity.run_id = 1
        TaskIdentity.node_id = SUPERLINK_NODE_ID
        self.clients = clients
        self.node_configs = node_configs
        self._run_id = 1

    @classmethod
    def for_app(cls, client_app: ClientFn, num_nodes: int) -> LocalGrid:
        ids = {1000 + i: i for i in range(num_nodes)}
        return cls(
            {n: client_app for n in ids},
            {n: {"partition-id": p, "num-partitions": num_nodes} for n, p in ids.items()},
        )

    def get_node_ids(self) -> Iterable[int]:
        return list(self.clients)

    def send_and_receive(self, messages: Iterable[Any], *, timeout: float | None = None):
        from flwr.app import Context, Error, Message, RecordDict

        replies = []
        for msg in messages:
            node = int(msg.metadata.dst_node_id)
            msg.metadata.__dict__["_message_id"] = str(uuid4())
            msg.metadata.__dict__["_run_id"] = self._run_id
            ctx = Context(
                run_id=self._run_id,
                node_id=node,
                node_config=dict(self.node_configs.get(node, {})),
                state=RecordDict(),
                run_config={},
            )
            try:
                reply = self.clients[node](msg, ctx)
            except Exception as exc:  # a crashing client must not stall the round
                logger.info("client %s raised %s", node, exc)
                reply = Message(Error(code=0, reason=repr(exc)), reply_to=msg)
            if reply is not None:
                replies.append(reply)
        return replies


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


def build_strategy(
    server_cfg: ServerConfig,
    task: TaskConfig,
    on_round: Callable[[RoundRecord], None] | None = None,
) -> DPFedAvg:
    if task.data:
        federation(task)  # the user's data: every data error (and the label gate) up front
    server = DPFedAvgServer(server_cfg, initial_arrays(task), make_evaluate_fn(task))
    return DPFedAvg(server, task.to_record(), on_round=on_round)


def run_local(
    server_cfg: ServerConfig,
    task: TaskConfig,
    on_round: Callable[[RoundRecord], None] | None = None,
    grid: Any = None,
) -> DPFedAvgServer:
    """Run the app in this process (no Ray)."""
    strategy = build_strategy(server_cfg, task, on_round)
    grid = grid or LocalGrid.for_app(build_client_app(), task.num_clients)
    return strategy.start(grid)


def run_simulation(
    server_cfg: ServerConfig,
    task: TaskConfig,
    on_round: Callable[[RoundRecord], None] | None = None,
    num_cpus: int = 2,
    verbose: int = 0,
) -> DPFedAvgServer:
    """Run the app in Flower's simulation engine with ``num_clients`` virtual SuperNodes.

    ``verbose`` 0 keeps the actors' output (Ray, transformers) out of the driver's console;
    1 forwards it; 2 also turns on Flower's debug log.
    """
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation as flwr_run_simulation

    holder: dict[str, DPFedAvgServer] = {}
    server_app = ServerApp()
    # Flower may run the ServerApp in another thread, which does not inherit context
    # variables: carry the caller's progress listener (the vote's progress) across
    caller = contextvars.copy_context()

    @server_app.main()
    def main(grid: Any, context: Any) -> None:
        strategy = build_strategy(server_cfg, task, on_round)
        holder["server"] = caller.copy().run(strategy.start, grid)

    init_args: dict[str, Any] = {"num_cpus": num_cpus, "include_dashboard": False}
    if not verbose:
        init_args.update(log_to_driver=False, logging_level="ERROR")
    backend = {
        "init_args": init_args,
        "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
    }
    t0 = time.perf_counter()
    flwr_run_simulation(
        server_app=server_app,
        client_app=build_client_app(),
        num_supernodes=task.num_clients,
        backend_config=backend,
        verbose_logging=verbose >= 2,
    )
    if "server" not in holder:
        raise RuntimeError("the simulation ended without running the ServerApp; see the log")
    logger.info("simulation finished in %.1fs", time.perf_counter() - t0)
    return holder["server"]


# --------------------------------------------------------------------------------------------
# Deployment components (``flwr run``)
# --------------------------------------------------------------------------------------------


def _from_run_config(cls: type, run_config: dict[str, Any]) -> Any:
    kwargs = {}
    for f in fields(cls):
        key = f.name.replace("_", "-")
        if key in run_config:
            default = getattr(cls, f.name, None)
            value = run_config[key]
            if isinstance(default, tuple):
                value = tuple(float(x) for x in str(value).split(","))
            elif default is not None and not isinstance(default, str):
                value = type(default)(value)
            kwargs[f.name] = value
    return cls(**kwargs)


def build_server_app():
    """ServerApp for a deployment; settings come from the run config (``--run-config``)."""
    from flwr.serverapp import ServerApp

    app = ServerApp()

    @app.main()
    def main(grid: Any, context: Any) -> None:
        rc = dict(context.run_config)
        task = _from_run_config(TaskConfig, rc)
        scfg = _from_run_config(ServerConfig, rc)
        server = build_strategy(scfg, task).start(grid)
        logger.info("finished: %s", [r.epsilon for r in server.history])
        out = rc.get("output", "")
        if out:
            from dpfit.federated.cli import write_outputs

            write_outputs(server, task, out, plots=False)

    return app


def __getattr__(name: str) -> Any:
    if name == "server_app":
        return build_server_app()
    if name == "client_app":
        return build_client_app()
    raise AttributeError(name)

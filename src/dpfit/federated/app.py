"""The Flower app: the ServerApp, and the ways to run it.

- ``run_simulation``: Flower's simulation engine (Ray), N virtual SuperNodes.
- ``run_local``: the same ClientApp and Strategy over ``LocalGrid``, an in-process Grid that
  calls the ClientApp directly: no Ray, for tests and benchmarks on small machines.
- ``server_app`` / ``client_app``: the components ``flwr run`` loads on a real deployment
  (the shipped ``flwr_app/pyproject.toml`` names them, see ``deploy``); the run config
  carries the settings.

Clients' data: the bundled Rotten Tomatoes data (IID, Dirichlet label skew, or natural
clients by movie; ``bundled``) or a user's own file (``TaskConfig.data``; ``data``), cut into
clients by the same partitioners (``data.partition_rows``); one client's examples and the
server's scoring split are read in ``examples``. Their names stay importable from here.
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from typing import Any
from uuid import uuid4

from dpfit.federated.bundled import PARTITIONS, partitions, splits  # noqa: F401 - re-exported
from dpfit.federated.client import build_client_app, initial_arrays
from dpfit.federated.clipping import clip_rule_class
from dpfit.federated.data import PartitionError, federation, subsample  # noqa: F401 - re-exported
from dpfit.federated.examples import client_examples, eval_split  # noqa: F401 - re-exported
from dpfit.federated.outputs import write_outputs
from dpfit.federated.scoring import make_evaluate_fn, make_trial_fn_for_task
from dpfit.federated.strategy import DPFedAvg, DPFedAvgServer, RoundRecord, ServerConfig
from dpfit.federated.task_config import TaskConfig

logger = logging.getLogger(__name__)

_subsample = subsample  # the name the benchmarks use


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
        return [reply for reply in self.deliver(messages) if reply is not None]

    def deliver(self, messages: Iterable[Any]) -> Iterator[Any]:
        """Each message's reply (None: no answer) as its client finishes, in order: what lets
        the server move a long stage's progress on per client (``strategy.gather_replies``)."""
        from flwr.app import Context, Error, Message, RecordDict

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
            yield reply


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
    trial = None
    if clip_rule_class(server_cfg.method).needs_public_trial:
        trial = make_trial_fn_for_task(task)
    server = DPFedAvgServer(server_cfg, initial_arrays(task), make_evaluate_fn(task), trial)
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
            write_outputs(server, task, out, plots=False)

    return app


def __getattr__(name: str) -> Any:
    if name == "server_app":
        return build_server_app()
    if name == "client_app":
        return build_client_app()
    raise AttributeError(name)

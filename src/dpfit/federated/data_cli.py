"""``dpfit federated``'s options for a user's own data, and what the run says about it.

The options map onto ``TaskConfig``'s data settings (``dpfit.federated.data`` reads them);
what is printed separates the public (N, where it comes from, label names: stdout) from what
is read from the private rows (client sizes: stderr, the operator's only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """A user's own data, read as ``dpfit train --data`` reads it (docs/federated.md)."""
    g = p.add_argument_group("your own data (default: bundled Rotten Tomatoes)")
    g.add_argument(
        "--data",
        default=None,
        help="CSV/JSONL/TSV file or saved `datasets` folder of the clients' rows",
    )
    g.add_argument(
        "--client-column",
        default=None,
        help="column saying whose each row is: each distinct value is one client (no "
        "default: without it, --partition iid|dirichlet cuts the rows into synthetic clients)",
    )
    g.add_argument(
        "--eval-data",
        default=None,
        help="the server's PUBLIC validation and test set (halved with --seed); needed with --data",
    )
    g.add_argument("--text-column", default="text", help="the text column (default: text)")
    g.add_argument("--label-column", default="label", help="the label column (default: label)")
    g.add_argument(
        "--labels",
        default=None,
        help="comma-separated public label names, e.g. neg,pos (their order fixes the class "
        "ids); as in `dpfit train`",
    )
    g.add_argument(
        "--public-labels",
        action="store_true",
        help="treat the label names read from --data as public even if some are rare "
        "(without --labels, each must otherwise appear >= 20 times)",
    )


def data_options(args: argparse.Namespace, defaults: dict[str, Any]) -> dict[str, Any]:
    """TaskConfig's data settings from the command line: the bundled data, or the user's
    file with natural clients (``--client-column``) or a synthetic partition. ``defaults``:
    the bundled run's N and per-client cap (``cli.DEFAULT_RUN``)."""
    partition = getattr(args, "partition", None)
    clients = getattr(args, "clients", None)
    per_client = getattr(args, "examples_per_client", None)
    data = getattr(args, "data", None)
    if not data:
        for flag in ("client_column", "eval_data", "labels", "public_labels"):
            if getattr(args, flag, None):
                option = "--" + flag.replace("_", "-")
                raise ValueError(f"{option} needs --data FILE (the bundled data has its own)")
        return {
            "num_clients": defaults["clients"] if clients is None else clients,
            "partition": partition or "iid",
            "examples_per_client": (
                defaults["examples_per_client"] if per_client is None else per_client
            ),
        }
    from dpfit.federated import data as fed_data
    from dpfit.federated.task_config import TaskConfig
    from dpfit.tasks.labels import parse_labels

    common = {
        "data": str(Path(data).resolve()),  # every process (Ray actor, SuperNode) reads it
        "eval_data": str(Path(args.eval_data).resolve()) if args.eval_data else "",
        "text_column": args.text_column,
        "label_column": args.label_column,
        "labels": ",".join(parse_labels(args.labels or "") or ()),
        "public_labels": bool(args.public_labels),
    }
    if not common["eval_data"]:
        raise ValueError(
            "--data needs --eval-data FILE: the server's public validation and test set "
            "(the clients' rows are private, so the server cannot score on them)"
        )
    if args.client_column:
        if partition is not None:
            raise ValueError(
                "give --client-column (each value one client) or --partition (synthetic "
                "clients), not both"
            )
        found = fed_data.natural_client_count(
            TaskConfig(**common, client_column=args.client_column, partition="column")
        )
        if clients is not None and clients != found:
            raise ValueError(
                f"--clients {clients}, but column {args.client_column!r} holds {found} "
                "clients; leave --clients out with --client-column"
            )
        return {
            **common,
            "client_column": args.client_column,
            "partition": "column",
            "num_clients": found,
            "examples_per_client": 0 if per_client is None else per_client,
        }
    partition = partition or "iid"
    if per_client is None:
        per_client = defaults["examples_per_client"]
    if clients is None:
        if per_client <= 0:
            raise ValueError(
                "--examples-per-client 0 (all) cannot size a synthetic partition: give --clients N"
            )
        rows = fed_data.user_row_count(TaskConfig(**common, partition=partition))
        clients = rows // per_client
        if clients < 2:
            raise ValueError(
                f"{data}: {rows} rows make fewer than 2 clients of {per_client}; pass a "
                "smaller --examples-per-client"
            )
    return {
        **common,
        "partition": partition,
        "num_clients": clients,
        "examples_per_client": per_client,
    }


def check_user_data(task: Any, clients_per_round: float) -> None:
    """Read, partition and check the user's data and the server's set now (every data error
    before a run starts), and that m fits in N."""
    from dpfit.federated.data import federation

    federation(task)
    if clients_per_round > task.num_clients:
        raise ValueError(
            f"--clients-per-round {clients_per_round:g} is more than the {task.num_clients} "
            f"clients of {task.data}; pass --clients-per-round {task.num_clients} or less"
        )


def clients_source(task: Any) -> str:
    """Where N comes from, and that it is public (q = m/N uses it)."""
    if task.partition == "column":
        return (
            f"the number of distinct values of column {task.client_column!r}, public by declaration"
        )
    if task.data:
        return f"a synthetic {task.partition} partition of --data (setup, public)"
    return "--clients (public)"


def data_notes(task: Any, quiet: bool) -> None:
    """The user's data: what is public on stdout; client sizes, read from the private rows,
    on stderr for the operator only (docs/federated.md, "What each output is")."""
    from dpfit.federated.data import federation

    fed = federation(task)
    part = fed.clients
    if not quiet:
        print(
            f"data: {task.data}; N = {task.num_clients} clients from "
            f"{clients_source(task)} (q = m/N); server's public set: {task.eval_data}",
            flush=True,
        )
        print(part.label_note, flush=True)
    k = task.local_batch_size
    cap = task.examples_per_client
    sizes = [min(len(idx), cap) if cap > 0 else len(idx) for idx in part.clients]
    small = sum(n < k for n in sizes)
    if small:
        print(
            f"operator note (not released): {small} of {len(sizes)} clients hold fewer than "
            f"one local batch ({k} examples); every client is kept and trains on what it holds",
            file=sys.stderr,
            flush=True,
        )

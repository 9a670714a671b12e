"""Client-level DP federated fine-tuning (DP-LAC on Flower) on a CSV of your own, with a column
that says which client each row belongs to.

    python examples/federated_csv.py                     # bundled reviews, one client per movie
    python examples/federated_csv.py --data mine.csv --client-column user \
        --eval-data public.csv --text-column review --label-column sentiment --labels neg,pos
    python examples/federated_csv.py --quick             # a smoke run

The same run from the command line is `dpfit federated --data ... --client-column ...
--eval-data ...` (docs/federated.md, "Your own data"); this script is its library form:
a `TaskConfig` (what clients train, on which data), a `ServerConfig` (privacy and schedule),
and `run_local`, which runs the Flower ClientApp and Strategy in this process.

Why each choice:
* Client-level DP: epsilon protects everything one client holds (all the rows with one
  value of --client-column), not one row. The number of clients N is public by declaration:
  the sampling rate q = m / N is computed from it.
* The server scores on --eval-data, a PUBLIC set (halved into validation and test): the
  clients' rows are private, and the validation loss steers DP-LAC's clip norm.
* Local training follows `dpfit federated`'s default run (`dpfit.federated.cli.DEFAULT_RUN`
  and `LOCAL_LR`): clients train a linear head on frozen MiniLM features (770 values), which
  few clients per round can average with little noise; `--local-mode bias` trains every bias
  too but needs many more clients per round.
* Without --data the script writes the bundled Rotten Tomatoes reviews as CSV files: each
  training movie is one client, and held-out movies form the server's public set.
"""

from __future__ import annotations

import argparse
import csv
import os
import tempfile
from pathlib import Path

from dpfit.data import bundled_rotten_tomatoes, rotten_tomatoes, split_by_group
from dpfit.federated.app import make_evaluate_fn, run_local
from dpfit.federated.cli import DEFAULT_RUN, LOCAL_LR, majority_accuracy
from dpfit.federated.client import TaskConfig
from dpfit.federated.data import natural_client_count
from dpfit.federated.data_cli import check_user_data
from dpfit.federated.strategy import ServerConfig


def write_demo_csvs(folder: Path, clients: int, eval_rows: int, seed: int) -> tuple[Path, Path]:
    """clients.csv (text,label,movie: `clients` movies of the training split, one client
    each) and public.csv (reviews of held-out movies): a stand-in for your own files."""
    names = bundled_rotten_tomatoes(seed).train.label_names
    train, _, test = split_by_group(rotten_tomatoes(), (0.8, 0.1, 0.1), seed=seed)
    movies = sorted({e.group for e in train})[:clients]
    kept = [e for e in train if e.group in set(movies)]
    paths = []
    for name, rows in (("clients", kept), ("public", test[:eval_rows])):
        path = folder / f"{name}.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["text", "label", "movie"])
            w.writerows([e.text, names[e.label], e.group] for e in rows)
        paths.append(path)
    return paths[0], paths[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="your CSV/JSONL of the clients' rows (default: bundled)")
    p.add_argument("--client-column", default="movie", help="whose each row is")
    p.add_argument("--eval-data", help="the server's PUBLIC validation/test set (with --data)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--label-column", default="label")
    p.add_argument("--labels", default="", help="public label names in id order, e.g. neg,pos")
    p.add_argument("--model", default="minilm", help="a folder, or minilm / smollm2 (bundled)")
    p.add_argument(
        "--local-mode", default=DEFAULT_RUN["local_mode"], choices=("head", "bias", "lora")
    )
    p.add_argument("--epsilon", type=float, default=8.0, help="client-level target")
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--clients-per-round", type=float, default=DEFAULT_RUN["clients_per_round"])
    p.add_argument("--rounds", type=int, default=DEFAULT_RUN["rounds"])
    p.add_argument("--demo-clients", type=int, default=411, help="movies in the demo data")
    p.add_argument("--examples-per-client", type=int, default=0, help="cap; 0 = all")
    p.add_argument("--eval-examples", type=int, default=200)
    p.add_argument("--max-length", type=int, default=48)
    p.add_argument("--seed", type=int, default=0, help="public randomness only")
    p.add_argument(
        "--quick",
        action="store_true",
        default=os.environ.get("DPFIT_EXAMPLES_QUICK") == "1",
        help="a smoke run: 12 clients, 2 rounds (also DPFIT_EXAMPLES_QUICK=1)",
    )
    args = p.parse_args(argv)
    if args.quick:  # small enough for the test suite; the numbers it prints mean nothing
        args.demo_clients, args.clients_per_round, args.rounds = 12, 4.0, 2
        args.examples_per_client, args.eval_examples, args.max_length = 8, 32, 32
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    if args.data is None:
        args.data, args.eval_data = write_demo_csvs(
            Path(tmp.name), args.demo_clients, 2 * args.eval_examples, args.seed
        )
        args.labels = args.labels or "rotten,fresh"
    if not args.eval_data:
        raise SystemExit("--data needs --eval-data: the server's public validation/test set")

    data = {
        "data": str(Path(args.data).resolve()),  # every client process reads the file
        "eval_data": str(Path(args.eval_data).resolve()),
        "client_column": args.client_column,
        "partition": "column",  # natural clients: one per value of the column
        "text_column": args.text_column,
        "label_column": args.label_column,
        "labels": args.labels,
    }
    num_clients = natural_client_count(TaskConfig(**data))  # N, public by declaration
    task = TaskConfig(
        **data,
        num_clients=num_clients,
        examples_per_client=args.examples_per_client,
        model=args.model,
        local_mode=args.local_mode,
        local_epochs=DEFAULT_RUN["local_epochs"],
        local_batch_size=DEFAULT_RUN["local_batch_size"],
        lr=LOCAL_LR[args.local_mode],
        max_length=args.max_length,
        eval_examples=args.eval_examples,
        seed=args.seed,
    )
    check_user_data(task, args.clients_per_round)  # every data error before any round
    server_cfg = ServerConfig(
        method="lac",  # DP-LAC: a private vote picks the clip norm, then DP-FedAvg rounds
        num_clients=num_clients,
        clients_per_round=args.clients_per_round,  # expected m; clients are Poisson-sampled
        rounds=args.rounds,
        target_epsilon=args.epsilon,  # the vote's share and the rounds together
        delta=args.delta,
    )
    print(
        f"{num_clients} clients (one per {args.client_column!r}), "
        f"{args.clients_per_round:g} expected per round, {args.rounds} rounds"
    )

    def on_round(r) -> None:
        print(f"round {r.round}: clip {r.clip_norm:.3g}, val accuracy {r.accuracy:.3f}")

    server = run_local(server_cfg, task, on_round=on_round)
    _, accuracy = make_evaluate_fn(task, "test")(server.params)
    print(f"majority class {majority_accuracy(task, 'test'):.3f} on the same test rows")
    print(
        f"epsilon {server.accountant.epsilon():.4f} (target {args.epsilon:g}, "
        f"delta {args.delta:.2g}, client-level)"
    )
    print(f"accuracy {accuracy:.3f} on the server's public test half")
    tmp.cleanup()


if __name__ == "__main__":
    main()

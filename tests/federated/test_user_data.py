"""A user's own federated data (`dpfit federated --data`): a client column or a synthetic
partition, read by `dpfit train`'s loader, through every engine; the label rule of
`dpfit train`; the errors; and the written Flower app (tiny random BERT, tiny files)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

try:
    import tomllib
except ImportError:  # Python 3.10: flwr's dependency
    import tomli as tomllib

from dpfit.federated import data as fed_data
from dpfit.federated.app import (
    _from_run_config,
    client_examples,
    eval_split,
    initial_arrays,
    run_local,
)
from dpfit.federated.batched import run_batched
from dpfit.federated.cli import add_arguments, configs, run
from dpfit.federated.client import TaskConfig
from dpfit.federated.data import client_partition
from dpfit.federated.strategy import ServerConfig
from dpfit.models import save_tiny_random_model

GOOD = "good great fine nice superb fun".split()
BAD = "bad awful poor dull terrible boring".split()


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> str:
    return str(save_tiny_random_model(tmp_path_factory.mktemp("bert"), arch="bert"))


def _rows(sizes: dict, seed: int = 0, labels=("neg", "pos")) -> list[dict]:
    """Rows of each client (client value -> number of rows), labels alternating by client
    so that both classes are common; every text is unique."""
    rng = np.random.default_rng(seed)
    out = []
    for c, n in sizes.items():
        for _ in range(n):
            y = len(out) % 2
            words = rng.choice(GOOD if y else BAD, size=3)
            out.append({"user": c, "text": f"{' '.join(words)} {len(out)}", "label": labels[y]})
    return out


def _write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return path


@pytest.fixture
def files(tmp_path):
    """A CSV of 6 named clients of uneven sizes (one smaller than a local batch) and a public
    evaluation file."""
    sizes = {"alice": 12, "bob": 3, "carol": 9, "dan": 7, "erin": 10, "fay": 8}
    train = _write(tmp_path / "train.csv", _rows(sizes))
    ev = [{"text": r["text"], "label": r["label"]} for r in _rows({"x": 24}, seed=9)]
    return train, _write(tmp_path / "eval.csv", ev), sizes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p


TINY = ["--max-length", "16", "--eval-examples", "0", "--local-batch-size", "4"]


def _args(bert: str, data: Path, ev: Path, *extra: str) -> list[str]:
    return ["--model", bert, "--data", str(data), "--eval-data", str(ev), *TINY, *extra]


# -- a client column, through the engines ------------------------------------------------------


def test_csv_client_column_round_trips_through_the_batched_engine(bert, files, tmp_path, capfd):
    train, ev, sizes = files
    out = tmp_path / "out"
    argv = _args(
        bert, train, ev, "--client-column", "user", "--engine", "batched",
        "--local-mode", "lora-top", "--clients-per-round", "3", "--rounds", "2",
        "--output", str(out), "--public-labels",
    )  # fmt: skip
    assert run(_parser().parse_args(argv)) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["rounds"] == 2 and 0 < m["epsilon"] <= 8.0 * (1 + 1e-6)
    assert m["num_clients"] == len(sizes) and m["partition"] == "column"
    assert m["client_column"] == "user" and m["label_names"] == ["neg", "pos"]
    assert "public by declaration" in m["num_clients_from"]
    captured = capfd.readouterr()
    assert "N = 6 clients" in captured.out and "q = m/N" in captured.out
    # 6 clients: no name read from the data is carried by 20 (the gate counts clients)
    assert "PUBLIC (declared public with --public-labels): neg, pos" in captured.out
    # the size of small clients is read from private rows: the operator's stderr only
    assert "1 of 6 clients hold fewer than one local batch" in captured.err
    assert "fewer than one local batch" not in captured.out
    assert "fewer than" not in (out / "metrics.json").read_text()
    # client i holds exactly the rows of the i-th client value, sorted (the protected unit)
    server, task = configs(_parser().parse_args(argv))
    assert server.num_clients == task.num_clients == len(sizes)
    rows = _rows(sizes)
    for i, name in enumerate(sorted(sizes)):
        got = Counter(e.text for e in client_examples(task, i))
        assert got == Counter(r["text"] for r in rows if r["user"] == name), name


def test_jsonl_integer_clients_in_numeric_order_with_declared_labels(bert, tmp_path):
    sizes = {10: 6, 2: 5, 1: 4}  # sorted as numbers: 1, 2, 10 (as text: 1, 10, 2)
    rows = _rows(sizes, labels=(0, 1))  # integer labels: the k-th --labels name
    train = _write(tmp_path / "train.jsonl", rows)
    ev = _write(tmp_path / "eval.jsonl", [{"text": "good fun", "label": 1}] * 2)
    out = tmp_path / "out"
    argv = _args(
        bert, train, ev, "--client-column", "user", "--labels", "neg,pos",
        "--engine", "batched", "--local-mode", "lora-top", "--clients-per-round", "2",
        "--rounds", "1", "--method", "fixed", "--output", str(out),
    )  # fmt: skip
    assert run(_parser().parse_args(argv)) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["rounds"] == 1 and m["num_clients"] == 3 and m["label_names"] == ["neg", "pos"]
    _, task = configs(_parser().parse_args(argv))
    assert [len(client_examples(task, i)) for i in range(3)] == [4, 5, 6]
    assert {e.label for i in range(3) for e in client_examples(task, i)} == {0, 1}


def test_datasets_folder_with_a_client_column_and_a_cap(tmp_path, bert):
    import datasets

    sizes = {"a": 5, "b": 9, "c": 2}
    rows = _rows({k: v for k, v in sizes.items()} | {"d": 30})  # both labels >= 20 rows
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    ev = _write(tmp_path / "eval.csv", [{"text": "good", "label": "pos"}] * 2)
    argv = _args(
        bert, folder, ev, "--client-column", "user", "--examples-per-client", "4",
        "--labels", "neg,pos",
    )  # fmt: skip
    server, task = configs(_parser().parse_args([*argv, "--clients-per-round", "2"]))
    assert task.num_clients == server.num_clients == 4
    assert [len(client_examples(task, i)) for i in range(4)] == [4, 4, 2, 4]
    part = client_partition(task)
    assert sorted(len(c) for c in part.clients) == [2, 5, 9, 30]  # the cap applies later


def test_local_flower_engine_equals_the_batched_engine_on_user_data(bert, files):
    """The in-process Flower run (ClientApp + Strategy) and the batched engine on the same
    file: the same clients, sampling and noise, so the same model."""
    train, ev, sizes = files
    task = TaskConfig(
        model=bert, local_mode="lora-top", max_length=16, local_batch_size=4, lr=0.05,
        num_clients=len(sizes), partition="column", client_column="user",
        examples_per_client=0, eval_examples=0, data=str(train), eval_data=str(ev),
        public_labels=True,
    )  # fmt: skip
    cfg = ServerConfig(
        method="fixed", num_clients=len(sizes), clients_per_round=3, rounds=2,
        target_epsilon=None, noise_multiplier=0.5, initial_clip=0.5, insecure_seed=3,
    )  # fmt: skip
    flower = run_local(cfg, task)
    batched = run_batched(cfg, task)
    assert len(flower.history) == len(batched.history) == 2
    start = initial_arrays(task)
    assert max(np.abs(a - b).max() for a, b in zip(flower.params, start, strict=True)) > 1e-3
    for a, b in zip(batched.params, flower.params, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    texts, labels = eval_split(task, "validation")
    assert len(texts) == 12 and set(labels) <= {0, 1}  # half of the public set


@pytest.mark.slow
def test_simulation_engine_takes_user_data(bert, files, tmp_path):
    train, ev, _ = files
    out = tmp_path / "out"
    argv = _args(
        bert, train, ev, "--client-column", "user", "--engine", "simulation",
        "--local-mode", "bias", "--clients-per-round", "2", "--rounds", "1",
        "--method", "fixed", "--output", str(out), "--public-labels",
    )  # fmt: skip
    assert run(_parser().parse_args(argv)) == 0
    m = json.loads((out / "metrics.json").read_text())
    assert m["rounds"] == 1 and m["num_clients"] == 6


# -- synthetic partitions -----------------------------------------------------------------------


def _sorted_file(tmp_path: Path, n: int = 40) -> tuple[Path, Path]:
    """A file sorted by label (all neg, then all pos): contiguous shards would be pure."""
    rows = sorted(_rows({"": n}), key=lambda r: r["label"])
    rows = [{"text": r["text"], "label": r["label"]} for r in rows]
    ev = _write(tmp_path / "eval.csv", rows[:2])
    return _write(tmp_path / "train.csv", rows), ev


def _clear_caches() -> None:
    """Read and partition again: equal results then come from the seed, not a cache."""
    fed_data.user_rows.cache_clear()
    fed_data._client_partition.cache_clear()


def _clients(task: TaskConfig) -> list[list[str]]:
    return [[e.text for e in client_examples(task, i)] for i in range(task.num_clients)]


def test_iid_partition_sizes_and_determinism(tmp_path, bert):
    train, ev = _sorted_file(tmp_path)
    argv = _args(
        bert, train, ev, "--partition", "iid", "--examples-per-client", "5", "--labels", "neg,pos"
    )  # fmt: skip
    _, task = configs(_parser().parse_args([*argv, "--clients-per-round", "2"]))
    assert task.num_clients == 40 // 5  # N = rows // --examples-per-client
    clients = _clients(task)
    # each row's client is its own hash's (stable when a row is added or removed: see
    # test_partition_neighbours.py), so sizes are binomial around 5, capped at 5
    assert all(1 <= len(c) <= 5 for c in clients) and sum(map(len, clients)) >= 30
    uncapped = client_partition(dataclasses.replace(task, examples_per_client=0)).clients
    assert sorted(i for c in uncapped for i in c) == list(range(40))  # each row in one client
    # each row's client from its own hash: a label-sorted file still gives mixed clients
    labels = [{e.label for e in client_examples(task, i)} for i in range(8)]
    assert sum(len(s) == 2 for s in labels) >= 4
    # public randomness from --seed: the same seed, the same clients; another, others
    _clear_caches()
    assert _clients(configs(_parser().parse_args([*argv, "--clients-per-round", "2"]))[1]) == (
        clients
    )
    other = configs(_parser().parse_args([*argv, "--clients-per-round", "2", "--seed", "1"]))[1]
    assert _clients(other) != clients
    # --clients given: N as given, each client capped at --examples-per-client
    _, task = configs(_parser().parse_args([*argv, "--clients", "4", "--clients-per-round", "2"]))
    assert task.num_clients == 4 and [len(c) for c in _clients(task)] == [5] * 4  # ~10 each


def test_dirichlet_partition_sizes_and_determinism(tmp_path, bert):
    train, ev = _sorted_file(tmp_path, n=60)
    argv = _args(
        bert, train, ev, "--partition", "dirichlet", "--dirichlet-alpha", "0.3",
        "--clients", "4", "--examples-per-client", "0", "--clients-per-round", "2",
        "--labels", "neg,pos",
    )  # fmt: skip
    _, task = configs(_parser().parse_args(argv))
    assert task.alpha == 0.3 and task.num_clients == 4
    clients = _clients(task)
    assert all(len(c) >= 2 for c in clients)  # the partitioner's minimum
    assert sorted(t for c in clients for t in c) == sorted(
        r["text"] for r in csv.DictReader(open(train))
    )
    _clear_caches()
    assert _clients(configs(_parser().parse_args(argv))[1]) == clients
    other = configs(_parser().parse_args([*argv, "--seed", "1"]))[1]
    assert _clients(other) != clients
    # label skew: Dirichlet(0.3) clients are further from the pooled 50/50 mix than IID ones
    skew = [abs(np.mean([e.label for e in client_examples(task, i)]) - 0.5) for i in range(4)]
    assert max(skew) > 0.2


# -- errors: one line, what to do ---------------------------------------------------------------


def _error(argv: list[str], capsys) -> str:
    assert run(_parser().parse_args(argv)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dpfit federated: error: ") and "\n" not in err, err
    return err


def test_missing_or_empty_client_column_names_the_columns(bert, files, tmp_path, capsys):
    train, ev, _ = files
    err = _error(_args(bert, train, ev, "--client-column", "usr"), capsys)
    assert "no column 'usr'" in err and "user, text, label" in err and "--client-column" in err
    rows = [{**r, "user": ""} for r in _rows({"a": 30})]
    empty = _write(tmp_path / "empty.csv", rows)
    err = _error(_args(bert, empty, ev, "--client-column", "user"), capsys)
    assert "empty in every row" in err and "user, text, label" in err


def test_a_file_with_one_client_is_refused(bert, tmp_path, files, capsys):
    _, ev, _ = files
    one = _write(tmp_path / "one.csv", _rows({"solo": 50}))
    err = _error(_args(bert, one, ev, "--client-column", "user"), capsys)
    assert "single client" in err and "--partition iid|dirichlet" in err


def test_unknown_labels_are_refused(bert, files, tmp_path, capsys):
    train, _, _ = files
    ev = _write(tmp_path / "ev.csv", [{"text": "good", "label": "meh"}] * 2)
    err = _error(_args(bert, train, ev, "--client-column", "user", "--public-labels"), capsys)
    assert "'meh'" in err and "training label set" in err
    _, ev, _ = files
    err = _error(_args(bert, train, ev, "--client-column", "user", "--labels", "neg,ok"), capsys)
    assert "'pos'" in err


def test_rare_label_names_follow_the_train_gate(bert, files, tmp_path, capsys):
    """Label names read from the data are published (metrics.json, the app's config): a name
    fewer than 20 clients carry (the privacy unit, as dpfit train counts its unit) needs
    --labels or --public-labels."""
    _, ev, _ = files
    rows = _rows({"a": 30, "b": 30})
    rows[0]["label"] = "Zed Q. Person"
    data = _write(tmp_path / "rare.csv", rows)
    err = _error(_args(bert, data, ev, "--client-column", "user"), capsys)
    assert "Zed Q. Person" in err and "--labels" in err and "--public-labels" in err
    argv = _args(bert, data, ev, "--client-column", "user", "--public-labels")
    _, task = configs(_parser().parse_args([*argv, "--clients-per-round", "2"]))
    assert client_partition(task).label_names == ("Zed Q. Person", "neg", "pos")
    # the gate counts the rows that train: a cap can leave a client without a name it holds
    rows = _rows({f"c{c:02d}": 10 for c in range(24)})
    for c in range(24):
        rows[10 * c]["label"] = "x"  # one row of each client: 24 clients carry it
    data = _write(tmp_path / "capped.csv", rows)
    full = _args(bert, data, ev, "--client-column", "user", "--clients-per-round", "2")
    assert "x" in client_partition(configs(_parser().parse_args(full))[1]).label_names
    err = _error([*full, "--examples-per-client", "5"], capsys)  # about 12 keep their x
    assert "x" in err.split("fewer than 20 clients (")[1].split(")")[0].split(", ")


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--client-column", "user", "--partition", "iid"], "not both"),
        (["--client-column", "user", "--clients", "4"], "holds 6 clients"),
        (
            ["--client-column", "user", "--clients-per-round", "9", "--public-labels"],
            "--clients-per-round 6 or less",
        ),
        (["--partition", "movie"], "--client-column"),
        (["--partition", "iid", "--examples-per-client", "0"], "--clients N"),
    ],
)
def test_bad_combinations_are_one_line_errors(bert, files, capsys, extra, expected):
    train, ev, _ = files
    assert expected in _error(_args(bert, train, ev, *extra), capsys)


def test_data_options_need_data_and_data_needs_a_public_eval_set(bert, files, capsys):
    train, ev, _ = files
    err = _error(["--model", bert, "--data", str(train), "--client-column", "user"], capsys)
    assert "--eval-data" in err and "public" in err
    for flag in (["--client-column", "user"], ["--eval-data", str(ev)], ["--labels", "a,b"]):
        assert "needs --data" in _error(["--model", bert, *flag], capsys)


# -- the written Flower app ---------------------------------------------------------------------


def test_written_flower_app_carries_the_data_options(bert, files, tmp_path, capsys):
    train, ev, _ = files
    argv = _args(
        bert, train, ev, "--client-column", "user", "--labels", "neg,pos",
        "--text-column", "text", "--clients-per-round", "3", "--rounds", "2",
    )  # fmt: skip
    app = tmp_path / "app"
    assert run(_parser().parse_args([*argv, "--write-app", str(app)])) == 0
    assert "flwr run" in capsys.readouterr().out
    rc = tomllib.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert rc["data"] == str(train.resolve()) and rc["eval-data"] == str(ev.resolve())
    assert rc["client-column"] == "user" and rc["partition"] == "column"
    assert rc["labels"] == "neg,pos" and rc["num-clients"] == 6
    server, task = configs(_parser().parse_args(argv))
    assert _from_run_config(TaskConfig, rc) == task
    assert _from_run_config(ServerConfig, rc) == server
    # a SuperNode started with partition-id=i gets the i-th client's rows from this config
    deployed = _from_run_config(TaskConfig, rc)
    assert {e.text for e in client_examples(deployed, 0)} == {
        e.text for e in client_examples(task, 0)
    }

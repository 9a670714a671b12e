"""`dpfit federated` through a tiny argparse: outputs, progress, engines (tiny sizes)."""

from __future__ import annotations

import argparse
import csv
import json
import re

import pytest

from dpfit.federated.cli import add_arguments, configs, run

TINY = [
    "--clients", "4", "--clients-per-round", "2", "--rounds", "2",
    "--examples-per-client", "8", "--eval-examples", "24", "--max-length", "24",
]  # fmt: skip


def _run(argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args(argv))


# What `dpfit federated` prints without -v: a header, where it writes, the vote's start and
# end, one line per round, then the table and what it wrote.
OWN_LINE = re.compile(
    r"^(dpfit federated: .*|output: .*|clip vote: .*|round +\d+/\d+  C=.*|\|.*\||wrote .*|)$"
)


def _foreign_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if not OWN_LINE.match(line)]


@pytest.mark.slow
def test_simulation_engine_writes_metrics_rounds_and_plots(tmp_path, capfd):
    out = tmp_path / "out"
    rc = _run([*TINY, "--method", "lac", "--epsilon", "8", "--output", str(out)])
    assert rc == 0
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("method", "epsilon", "delta", "accuracy", "rounds", "initial_clip", "final_clip"):
        assert key in metrics
    assert metrics["method"] == "lac" and metrics["rounds"] == 2
    assert 0 < metrics["epsilon"] <= 8.0 * (1 + 1e-6)
    assert metrics["final_clip"] <= metrics["initial_clip"]  # LAC never increases C
    rows = list(csv.DictReader(open(out / "rounds.csv")))
    assert [int(r["round"]) for r in rows] == [1, 2]
    for col in ("clip_norm", "val_loss", "accuracy", "epsilon", "noise_std"):
        assert col in rows[0]
    assert not any("client" in col for col in rows[0])  # exact counts are operator-only
    for png in ("clip.png", "accuracy.png", "epsilon.png"):
        assert (out / png).stat().st_size > 0
    captured = capfd.readouterr()  # file descriptors: the Ray actors write to them too
    assert "round   2/2" in captured.out
    assert "clip vote: done" in captured.out  # the ServerApp's thread reaches the listener
    # no Ray actor logs, Flower warnings or transformers load reports without -v
    assert _foreign_lines(captured.out) == []
    assert captured.err == ""


def test_default_output_is_rounds_and_table_only(capfd):
    """Without -v: the header, one line per round and the table; nothing from Flower or
    transformers (the local engine runs the same ClientApp and Strategy in this process)."""
    assert _run([*TINY, "--engine", "local"]) == 0
    captured = capfd.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("dpfit federated: lac, eps=8")
    assert lines[1].startswith("output: ") and "--output DIR" in lines[1]
    # the vote is the longest silent stretch before round 1: it says when it starts and ends
    assert lines[2] == "clip vote: 4 clients score the candidates ..."
    assert lines[3] == "clip vote: done"
    assert sum(line.startswith("round ") for line in lines) == 2
    assert "majority class" in captured.out and "test acc" in captured.out
    assert _foreign_lines(captured.out) == []
    assert captured.err == ""


def test_verbose_lets_flower_log():
    """-v is where Flower's (and Ray's, transformers') logs go; the mirror of the test above.

    Checked on the logger's level, not on captured output: Flower's console handler keeps the
    stream it found when flwr was first imported, which pytest's capture may have replaced.
    """
    import logging

    from dpfit.federated.cli import quiet_third_party

    args = argparse.ArgumentParser()
    add_arguments(args)
    ns = args.parse_args([*TINY, "--engine", "local", "--rounds", "1", "--method", "fixed"])
    ns.verbose = 1
    try:
        assert run(ns) == 0
        assert logging.getLogger("flwr").isEnabledFor(logging.INFO)
        quiet_third_party(0)
        assert not logging.getLogger("flwr").isEnabledFor(logging.INFO)
    finally:
        ns.verbose = 0
        quiet_third_party(0)


@pytest.mark.parametrize(
    "extra",
    [
        ["--method", "clac", "--partition", "dirichlet", "--alpha", "0.5"],
        ["--method", "adaptive-quantile", "--partition", "movie", "--local-mode", "lora"],
    ],
)
def test_local_engine_methods_partitions_modes(extra, capsys):
    rc = _run([*TINY, "--engine", "local", "--json", *extra])
    assert rc == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["rounds"] == 2 and metrics["epsilon"] <= 8.0 * (1 + 1e-6)


def test_no_noise_reports_infinite_epsilon(capsys):
    rc = _run(
        [*TINY, "--engine", "local", "--json", "--method", "fixed", "--noise-multiplier", "0"]
    )
    assert rc == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["epsilon"] == "inf"


def test_impossible_budget_is_a_clear_error(capsys):
    rc = _run(
        [*TINY, "--engine", "local", "--method", "lac", "--epsilon", "0.1", "--vote-noise", "1"]
    )
    assert rc == 2
    assert "vote noise" in capsys.readouterr().err


def test_insecure_reproducible_noise_is_opt_in_and_recorded(capsys):
    base = [*TINY, "--engine", "local", "--json", "--method", "fixed", "--rounds", "1"]
    assert _run(base) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["insecure_seed"] is False
    assert _run([*base, "--insecure-reproducible-noise"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["insecure_seed"] is True
    assert "NOT private" in captured.err


def test_default_run_follows_its_rule():
    """The default m is the smallest multiple of 10 for which the noise on the averaged update
    is at most half the largest update: z * sqrt(d) / m <= 1/2 (cli.DEFAULT_RUN)."""
    from dataclasses import replace

    from dpfit.federated.app import initial_arrays
    from dpfit.federated.strategy import DPFedAvgServer

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    server_cfg, task = configs(parser.parse_args([]))
    arrays = initial_arrays(task)
    d = sum(a.size for a in arrays)

    def noise_to_clip(m: float) -> float:
        cfg = replace(server_cfg, clients_per_round=m)
        return DPFedAvgServer(cfg, arrays).rule.update_multiplier * d**0.5 / m

    m = server_cfg.clients_per_round
    assert noise_to_clip(m) <= 0.5 < noise_to_clip(m - 10)


def test_client_learning_rate_follows_the_local_mode_unless_given():
    from dpfit.federated.cli import LOCAL_LR

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def lr(*argv: str) -> float:
        return configs(parser.parse_args(list(argv)))[1].lr

    assert lr() == LOCAL_LR["head"] == 1e-2  # the default run trains heads
    assert lr("--local-mode", "bias") == LOCAL_LR["bias"] < LOCAL_LR["head"]
    assert lr("--local-mode", "lora") == LOCAL_LR["lora"]
    assert lr("--local-mode", "bias", "--lr", "0.05") == 0.05


def test_batched_engine_runs_from_the_cli(capsys):
    rc = _run(
        [*TINY, "--engine", "batched", "--local-mode", "lora-top", "--local-optimizer", "sgd",
         "--method", "clac", "--json"]
    )  # fmt: skip
    assert rc == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["rounds"] == 2 and metrics["epsilon"] <= 8.0 * (1 + 1e-6)
    assert metrics["local_mode"] == "lora-top"


def test_batched_engine_refuses_a_mode_it_cannot_batch(capsys):
    rc = _run([*TINY, "--engine", "batched", "--local-mode", "lora"])
    assert rc == 2
    err = capsys.readouterr().err
    # the modes it runs, each with what it trains, and where the others run
    assert "lora-top (LoRA on the top layer's" in err and "bias (BiTFiT: every bias" in err
    assert "use --engine local for lora or head" in err


def test_vote_factors_set_the_lac_candidates():
    from dpfit.federated.app import initial_arrays
    from dpfit.federated.strategy import DPFedAvgServer

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--method", "lac", "--initial-clip", "2", "--vote-factors", "0.5", "1", "2"]
    server_cfg, task = configs(parser.parse_args(argv))
    assert server_cfg.vote_factors == (0.5, 1.0, 2.0)
    assert DPFedAvgServer(server_cfg, initial_arrays(task)).rule.candidates() == [1.0, 2.0, 4.0]
    default_cfg, _ = configs(parser.parse_args(["--method", "lac"]))
    assert default_cfg.vote_factors == (0.25, 0.5, 1.0)


@pytest.mark.parametrize("factors", [["1"], ["0.5", "0.5"], ["-1", "1"]])
def test_bad_vote_factors_are_a_one_line_error(factors, capsys):
    assert _run([*TINY, "--method", "lac", "--vote-factors", *factors]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vote_factors" in err[0], err


def test_batched_engine_with_the_default_mode_says_which_flag_to_add(capsys):
    """The other defaults train heads, which the batched engine cannot batch: one line, with
    the command's prefix, the modes it has and the flag to add; refused before any model."""
    assert _run(["--engine", "batched"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("dpfit federated: error: --engine batched runs local mode lora-top")
    assert "got --local-mode head" in err[0] and "add --local-mode lora-top" in err[0]


def test_a_run_keeps_its_outputs_in_a_new_run_folder_by_default(tmp_path, monkeypatch, capsys):
    """Like `dpfit train`: runs/federated-<date-time>/ unless --output (or --no-output)."""
    monkeypatch.setenv("DPFIT_RUNS_DIR", str(tmp_path / "runs"))
    base = [*TINY, "--engine", "local", "--method", "fixed", "--rounds", "1"]
    assert _run(base) == 0
    (folder,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"federated-\d{8}-\d{6}", folder.name)
    assert json.loads((folder / "metrics.json").read_text())["rounds"] == 1
    assert (folder / "rounds.csv").is_file()
    out = capsys.readouterr().out
    assert f"output: {folder}" in out and f"wrote {folder}/metrics.json" in out
    assert _run([*base, "--no-output"]) == 0
    assert len(list((tmp_path / "runs").iterdir())) == 1
    assert _run([*base, "--output", str(folder)]) == 2  # an earlier run is never overwritten
    assert "already holds a run" in capsys.readouterr().err


def test_table_and_round_line_show_the_same_last_clip(tmp_path, capsys):
    """The table's clip is the one the last round ran with, as its round line prints it (the
    clip after the last update, a next round's, is metrics.json's final_clip)."""
    out = tmp_path / "out"
    argv = [*TINY, "--engine", "local", "--method", "dynamic", "--output", str(out)]
    assert _run(argv) == 0  # dynamic: C_t = C_0 rho^(t/T), a new clip after every round
    text = capsys.readouterr().out
    last_line = [ln for ln in text.splitlines() if ln.startswith("round ")][-1]
    clip_in_line = re.search(r"C=(\S+)", last_line)[1]
    header, _, row = [ln for ln in text.splitlines() if ln.startswith("|")]
    cells = dict(zip(header.split("|"), row.split("|"), strict=True))
    assert cells[" C last round "].strip() == clip_in_line
    m = json.loads((out / "metrics.json").read_text())
    rows = list(csv.DictReader(open(out / "rounds.csv")))
    assert m["last_round_clip"] == pytest.approx(float(rows[-1]["clip_norm"]))
    assert m["final_clip"] != pytest.approx(m["last_round_clip"])  # the two quantities differ


def test_batched_vote_and_frozen_features_report_progress_as_they_go():
    """The batched vote moves on within a chunk of clients (its local steps, then each
    candidate), and the frozen-feature pass reports its chunks: no long silent stretch."""
    from dpfit import progress
    from dpfit.federated.batched import FEATURES_STAGE, run_batched

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = [*TINY, "--engine", "batched", "--local-mode", "lora-top", "--method", "lac",
            "--rounds", "1"]  # fmt: skip
    server_cfg, task = configs(parser.parse_args(argv))
    reports: list[tuple[str, int, int]] = []
    with progress.listening(lambda *r: reports.append(r)):
        run_batched(server_cfg, task)
    vote = [done for stage, done, total in reports if stage == "clip vote"]
    # one chunk of 4 clients, a quarter of it each: local training, then each of 3 candidates
    assert vote == sorted(vote) and set(vote) == {0, 1, 2, 3, 4}, vote
    features = [(done, total) for stage, done, total in reports if stage == FEATURES_STAGE]
    assert any(done < total for done, total in features)  # reported from its start, not only
    assert features[-1][0] == features[-1][1]  # at its end


def test_local_vote_reports_progress_per_client():
    """The local engine's vote moves on with each client's vote, as the batched engine's does
    (it used to report only its start and end: a long silent stretch with many clients)."""
    from dpfit import progress
    from dpfit.federated.app import run_local

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = [*TINY, "--engine", "local", "--method", "lac", "--rounds", "1"]
    server_cfg, task = configs(parser.parse_args(argv))
    reports: list[tuple[str, int, int]] = []
    with progress.listening(lambda *r: reports.append(r)):
        run_local(server_cfg, task)
    vote = [(done, total) for stage, done, total in reports if stage == "clip vote"]
    assert vote == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4)], vote

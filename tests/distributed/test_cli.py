"""`dpfit train --nproc-per-node N`: the torchrun command it builds, the rank-0 guard, and one
short 2-process run end to end (tiny local model and data)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dp_accounting
import pytest

from dpfit import distributed
from dpfit.models import save_tiny_random_model, write_tiny_sentiment_csv

SRC = Path(__file__).resolve().parents[2] / "src"


def test_launch_command_reruns_dpfit_under_torchrun_without_the_option():
    argv = ["train", "--nproc-per-node", "2", "--data", "d.csv", "--nproc-per-node=3", "--json"]
    rest = distributed.strip_option(argv, "--nproc-per-node")
    assert rest == ["train", "--data", "d.csv", "--json"]
    assert distributed.launch_command(2, rest) == [
        "--nproc-per-node=2", "-m", "dpfit", "train", "--data", "d.csv", "--json",
    ]  # fmt: skip


def test_main_process_guard_follows_the_rank(monkeypatch):
    assert distributed.is_main_process()  # no process group: the one process is the main one
    monkeypatch.setattr(distributed, "get_rank", lambda: 1)
    assert not distributed.is_main_process()


def test_launched_by_torchrun_reads_its_environment(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not distributed.launched_by_torchrun()
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert distributed.launched_by_torchrun()


@pytest.mark.slow
def test_two_process_train_prints_and_writes_once(tmp_path):
    model = save_tiny_random_model(tmp_path / "model")
    data = write_tiny_sentiment_csv(tmp_path / "data.csv", n=240)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}
    cmd = [
        sys.executable, "-m", "dpfit", "train", "--nproc-per-node", "2", "--model", str(model),
        "--data", str(data), "--epochs", "1", "--batch-size", "16", "--physical-batch-size", "8",
        "--noise-multiplier", "1.0", "--max-steps", "3", "--threads", "1", "--json",
        "--output", str(tmp_path / "out"), "--checkpoint-dir", str(tmp_path / "ck"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, proc.stdout  # rank 0 only
    m = json.loads(lines[0])
    assert m["steps"] == 3
    assert proc.stderr.count("note: no --eval-data") == 1
    acc = dp_accounting.rdp.RdpAccountant()
    q = m["sample_rate"]
    steps = 3 + m.get("head_first_steps", 0)  # the recipe's head-first phase shares the ledger
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)), steps)
    assert m["epsilon"] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert saved["steps"] == 3
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.suffix == ".pt")

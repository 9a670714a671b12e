"""`dpfit train --nproc-per-node N`: the torchrun command it builds, the rank-0 guard, and
short 2-process runs end to end (tiny local models and data), one with the document privacy
unit against the same run in one process."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import dp_accounting
import pytest
from safetensors.torch import load_file

from dpfit import checkpoint as ckpt
from dpfit import distributed
from dpfit.cli import main as dpfit_main
from dpfit.models import TINY_WORDS, save_tiny_random_model, write_tiny_sentiment_csv

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


def _ranks_of(token: str) -> dict[int, int]:
    """{rank: pid} of the worker processes whose environment carries `token` (Linux /proc)."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = dict(
                kv.split("=", 1) for kv in (proc / "environ").read_text().split("\0") if "=" in kv
            )
        except OSError:
            continue
        if env.get("DPFIT_TEST_JOB") == token and "RANK" in env:
            found[int(env["RANK"])] = int(proc.name)
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks through /proc")
def test_killed_rank_fails_the_job_and_resume_finishes_like_an_uninterrupted_run(tmp_path):
    """`dpfit train --nproc-per-node 2` (physical batches of 8): SIGKILL rank 1 after a few
    checkpoints; the job exits non-zero without hanging; `--resume` (2 processes again) ends
    with the steps and epsilon of the uninterrupted run, i.e. dp-accounting's figure for
    (sigma, q, every step). Both jobs print and write once, from rank 0 (one job per check
    would start the same processes again)."""
    model = save_tiny_random_model(tmp_path / "model")
    data = write_tiny_sentiment_csv(tmp_path / "data.csv", n=240)
    token = f"{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC), "DPFIT_TEST_JOB": token}
    ck, total = tmp_path / "ck", 40
    cmd = [
        sys.executable, "-m", "dpfit", "train", "--nproc-per-node", "2", "--model", str(model),
        "--data", str(data), "--epochs", "10", "--batch-size", "16", "--physical-batch-size", "8",
        "--noise-multiplier", "1.0", "--max-steps", str(total), "--threads", "1", "--json",
        "--output", str(tmp_path / "out"), "--checkpoint-dir", str(ck), "--checkpoint-every", "1",
    ]  # fmt: skip
    job = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, killed = time.monotonic() + 240, None
        while killed is None and job.poll() is None and time.monotonic() < deadline:
            steps = [s for s, _ in ckpt.list_checkpoints(ck)]
            ranks = _ranks_of(token)
            if steps and steps[-1] >= 3 and 1 in ranks:
                os.kill(ranks[1], signal.SIGKILL)
                killed = steps[-1]
            time.sleep(0.02)
        assert killed is not None, "the run ended (or hung) before rank 1 could be killed"
        t_kill = time.monotonic()
        _, err = job.communicate(timeout=90)
        assert job.returncode != 0, err[-2000:]
        assert time.monotonic() - t_kill < 90
        assert err.count("note: no --eval-data") == 1  # rank 0 only, rank 1 ran 3+ steps
    finally:
        if job.poll() is None:
            job.kill()
        for pid in _ranks_of(token).values():  # no rank left behind
            os.kill(pid, signal.SIGKILL)
    left = [s for s, _ in ckpt.list_checkpoints(ck)]
    assert left and 3 <= left[-1] < total
    assert not (tmp_path / "out" / "metrics.json").exists()

    proc = subprocess.run([*cmd, "--resume"], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, proc.stdout  # rank 0 only
    assert proc.stderr.count("note: no --eval-data") == 1
    m = json.loads(lines[0])
    assert m["steps"] == total
    acc = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(
        m["sample_rate"], dp_accounting.GaussianDpEvent(1.0)
    )
    acc.compose(event, total + m.get("head_first_steps", 0))
    assert m["epsilon"] == pytest.approx(acc.get_epsilon(m["delta"]), rel=1e-9)
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["steps"] == total


@pytest.mark.slow
def test_two_process_document_unit_run_is_the_one_process_run(tmp_path):
    """`dpfit train --task causal-lm --privacy-unit document --nproc-per-node 2` with one
    insecure seed: the same sampled documents and noise as one process, so the same epsilon
    and the same trained model (documents of 1 to 4 windows, physical batches of 3)."""
    model = save_tiny_random_model(tmp_path / "llama", arch="llama")
    words = random.Random(0)
    data = tmp_path / "docs.jsonl"
    data.write_text(
        "\n".join(
            json.dumps({"text": " ".join(words.choices(TINY_WORDS, k=6 + (i * 7) % 45))})
            for i in range(60)
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(SRC)}

    def run(name: str, *extra: str) -> tuple[dict, dict]:
        """One process: `dpfit train` called in this one (a process start costs more than
        the run); `--nproc-per-node`: the command in a subprocess, as a user runs it."""
        argv = [
            "train", "--task", "causal-lm", "--model", str(model),
            "--data", str(data), "--max-length", "16", "--stride", "12",
            "--privacy-unit", "document", "--batch-size", "4", "--physical-batch-size", "3",
            "--epochs", "2", "--epsilon", "8", "--seed", "5", "--insecure-reproducible-noise",
            "--threads", "1", "--quiet", "--json", "--output", str(tmp_path / name),
            # float32: the ranks add in another order, equal to float32 rounding (1e-5 below);
            # the default, bf16 where the CPU has it, would round each order at bf16's 2^-9
            "--precision", "fp32", *extra,
        ]  # fmt: skip
        if extra:
            cmd = [sys.executable, "-m", "dpfit", *argv]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
        else:
            assert dpfit_main(argv) == 0
        metrics = json.loads((tmp_path / name / "metrics.json").read_text())
        return metrics, load_file(str(tmp_path / name / "model" / "model.safetensors"))

    one, params_one = run("one")
    two, params_two = run("two", "--nproc-per-node", "2")
    assert two["privacy_unit"] == "document" and two["train_documents"] == one["train_documents"]
    assert two["steps"] == one["steps"] >= 20
    assert two["epsilon"] == one["epsilon"] and two["sample_rate"] == one["sample_rate"]
    # the added biases start at zero: their values are what training moved (AdamW over the
    # steps); the ranks' sums add in another order, so equal up to rounding, not bit for bit
    trained = [k for k in params_one if k.endswith(".bias")]
    scale = max(float(params_one[k].abs().max()) for k in trained)
    assert scale > 0
    for name, t in params_one.items():
        err = float((params_two[name].double() - t.double()).abs().max())
        assert err <= 1e-5 * scale, (name, err, scale)

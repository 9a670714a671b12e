"""Launch gloo jobs of `dist_worker.py` on this machine, one OS process per rank."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
SRC = HERE.parent.parent / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    out: Path, world: int, *scenarios: str, timeout: float = 240, script: str = "dist_worker.py"
) -> list[int]:
    """Run every rank of `script` to completion (or the timeout: then kill and fail); return
    exit codes."""
    port = free_port()
    paths = os.pathsep.join(map(str, (SRC, HERE, HERE.parent)))  # HERE.parent: shared test data
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": paths}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / script),
                str(r),
                str(world),
                str(port),
                str(out),
                *scenarios,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    codes, logs = [], []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"distributed job hung (> {timeout}s): {scenarios}")
        codes.append(p.returncode)
        logs.append(stdout)
    launch.logs = logs  # type: ignore[attr-defined]
    return codes


def results(out: Path, world: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]

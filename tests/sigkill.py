"""Kill a `dpfit` CLI run with SIGKILL once it has checkpointed a given step.

Why one helper: the resume tests of every run kind (text, long documents, images) must kill
the same way (no cleanup handler runs, the kill lands anywhere inside a later step or
checkpoint write) for their "resumes as if never killed" claims to mean the same thing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from dpfit import checkpoint as ckpt


def kill_after_checkpoint(
    argv: list[str], checkpoint_dir: Path, kill_at: int, delay: float, timeout: float = 180.0
) -> int:
    """Run `python -m dpfit.cli argv`, SIGKILL it `delay` seconds after a checkpoint of step
    >= kill_at appears, and return the last checkpointed step (asserting it was killed)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dpfit.cli", *argv],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        found = ckpt.list_checkpoints(checkpoint_dir)
        if found and found[-1][0] >= kill_at:
            time.sleep(delay)  # land somewhere inside a later step or checkpoint write
            proc.kill()
            break
        time.sleep(0.002)
    proc.wait(timeout=60)
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.returncode == -9, (
        f"run was not killed (rc={proc.returncode}, kill_at={kill_at}): {err[-2000:]}"
    )
    return ckpt.list_checkpoints(checkpoint_dir)[-1][0]


def assert_resumed_as_uninterrupted(
    out: Path,
    params: dict[str, torch.Tensor],
    metrics: dict,
    ref_params: dict[str, torch.Tensor],
    ref_metrics: dict,
    same: tuple[str, ...],
    msg: str,
) -> None:
    """The resumed run in `out` is the uninterrupted one: its steps, epsilon and `same` metrics,
    every parameter bit for bit, and one steps.csv row per step (none counted twice or lost)."""
    total = ref_metrics["steps"]
    assert metrics["steps"] == total, msg
    assert metrics["epsilon"] == ref_metrics["epsilon"], msg
    for key in same:
        assert metrics[key] == ref_metrics[key], f"{key}: {msg}"
    assert set(params) == set(ref_params)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=f"{name}: {msg}")
    assert len((out / "steps.csv").read_text().splitlines()) == total + 1, msg


def as_if_crashed_after(checkpoint_dir: Path, step: int) -> None:
    """Leave `checkpoint_dir` as a crash right after checkpoint `step` would have: the later
    checkpoints gone, and with them the claims that they and the later releases made on the
    older ones (a resume's own claim stays) and the later lines of the release log."""
    import json

    for at, path in ckpt.list_checkpoints(checkpoint_dir):
        for marker in ckpt.continuation_markers(path):
            if at > step or json.loads(marker.read_text()).get("reached", -1) > step:
                marker.unlink()
        if at > step:
            path.unlink()
    log = Path(checkpoint_dir) / ckpt.RELEASES
    if log.exists():
        kept = [ln for ln in log.read_text().splitlines() if json.loads(ln)["step"] <= step]
        log.write_text("".join(f"{ln}\n" for ln in kept))

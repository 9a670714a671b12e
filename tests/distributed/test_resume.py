"""Kill one rank mid-run: the job fails (no hang), and resuming from rank 0's last checkpoint,
here on ONE process (another world size, same q), ends with the uninterrupted run's epsilon
and step count."""

from __future__ import annotations

import time

import dist_worker
import pytest
from conftest import launch

from dpfit import checkpoint as ckpt


def test_killed_rank_fails_the_job_and_resume_matches_uninterrupted(tmp_path):
    total, die_at = 8, 3
    ck = tmp_path / "ck"
    t0 = time.monotonic()
    codes = launch(tmp_path, 2, f"kill:{ck}:{total}:{die_at}", timeout=120)
    assert codes[1] == 3  # the rank we killed
    assert codes[0] != 0, "the surviving rank must fail, not finish alone"
    assert time.monotonic() - t0 < 120
    steps = [s for s, _ in ckpt.list_checkpoints(ck)]
    assert steps and die_at <= steps[-1] < total

    resumed = dist_worker.run_until(1, str(ck), total)
    clean = dist_worker.run_until(1, str(tmp_path / "clean"), total)
    assert resumed["steps"] == clean["steps"] == total
    assert resumed["epsilon"] == pytest.approx(clean["epsilon"], rel=1e-12)

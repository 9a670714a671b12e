"""A real Flower deployment on localhost: one SuperLink, two SuperNodes, `flwr run` of the app.

Offline: the SuperLink is started with --disable-runtime-dependency-installation (SuperNodes
do not install by default), so no `uv sync` runs and the app uses this environment, and the
app's pyproject declares no dependencies. `flwr run` reaches the SuperLink through a
connection in a temporary FLWR_HOME/config.toml.
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

APP = Path(__file__).parent / "flwr_app"
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _stop(proc: subprocess.Popen) -> None:
    """Stop a process we started and its children (its own session), by its id."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
    except ProcessLookupError:
        pass


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_flwr_run_on_local_superlink_and_two_supernodes(tmp_path):
    if not (BIN / "flower-superlink").exists():
        pytest.skip("flwr CLI not installed (pip install dpfit[flwr])")
    home = tmp_path / "flwr_home"
    home.mkdir()
    port = _free_port()
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\n'
        f'address = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    env = dict(os.environ, FLWR_HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # the SuperLink starts `flower-superexec` from PATH: the venv may not be activated
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    app = tmp_path / "app"
    shutil.copytree(APP, app)
    out = tmp_path / "out"
    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            _start(
                [
                    str(BIN / "flower-superlink"), "--insecure",
                    "--disable-runtime-dependency-installation",
                    "--host", "127.0.0.1", "--port", str(port),
                    "--database", str(tmp_path / "state.db"),
                ],
                tmp_path / "superlink.log",
                env,
            )
        )  # fmt: skip
        for i in range(2):
            procs.append(
                _start(
                    [
                        str(BIN / "flower-supernode"), "--insecure",
                        "--superlink", f"127.0.0.1:{port}",
                        "--port", str(_free_port()),
                        "--node-config", f"partition-id={i} num-partitions=2",
                    ],
                    tmp_path / f"supernode{i}.log",
                    env,
                )
            )  # fmt: skip
        time.sleep(3)
        run = subprocess.run(
            [
                str(BIN / "flwr"), "run", str(app), "deploy", "--stream",
                "--run-config", f"output='{out}'",
            ],
            env=env, capture_output=True, text=True, timeout=360,
        )  # fmt: skip
        logs = run.stdout + run.stderr
        assert run.returncode == 0, logs[-3000:]
        deadline = time.time() + 60
        while not (out / "rounds.csv").exists() and time.time() < deadline:
            time.sleep(1)
        assert (out / "metrics.json").exists(), logs[-3000:]
        rows = list(csv.DictReader(open(out / "rounds.csv")))
        assert [int(r["round"]) for r in rows] == [1, 2]
        assert not any("client" in col for col in rows[0])  # counts stay in the operator log
        for i in range(2):  # every SuperNode trained (client counts are not released)
            assert "train" in (tmp_path / f"supernode{i}.log").read_text().lower()
        assert 0 < float(rows[-1]["epsilon"]) <= 8.0 * (1 + 1e-6)
    finally:
        for p in reversed(procs):
            _stop(p)
    assert all(p.poll() is not None for p in procs)

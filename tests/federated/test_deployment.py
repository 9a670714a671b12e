"""Real Flower deployments on localhost of the app dpfit ships: one SuperLink, two SuperNodes,
`flwr run` of the app that `dpfit federated --write-app` writes.

Offline: the SuperLink is started with --disable-runtime-dependency-installation (SuperNodes
do not install by default), so no `uv sync` runs and the app uses this environment, and the
app's pyproject declares no dependencies. `flwr run` reaches the SuperLink through a
connection in a temporary FLWR_HOME/config.toml.

The secure test follows the recipe of docs/federated.md ("Deployment"): certificates made
with openssl, SuperNode keys with ssh-keygen, TLS on the SuperLink, SuperNodes that verify it
with the CA certificate and authenticate with registered keys, and a SuperNode with an
unregistered key that the SuperLink refuses.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpfit.federated.cli import add_arguments, run
from dpfit.models import save_tiny_random_model

BIN = Path(sys.executable).parent
REFUSED = "No SuperNode found with the given public key"  # the SuperLink's log line (flwr 1.42)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _stop(procs: list[subprocess.Popen]) -> None:
    """Stop processes we started and their children (each its own session), by their ids:
    SIGTERM to all first, so that they shut down side by side, then SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=5)


def _sh(cmd: list[str], env: dict | None = None, timeout: float = 120) -> str:
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd[0]} failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
    return res.stdout


def _write_app(directory: Path, argv: list[str]) -> None:
    """The shipped app with these `dpfit federated` options as run config."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([*argv, "--write-app", str(directory)])) == 0


def _env(home: Path) -> dict:
    env = dict(os.environ, FLWR_HOME=str(home), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # the SuperLink starts `flower-superexec` from PATH: the venv may not be activated
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _connection(home: Path, port: int, ca: Path | None) -> None:
    security = f'root-certificates = "{ca}"' if ca else "insecure = true"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\n'
        f'address = "127.0.0.1:{port}"\n{security}\n'
    )


def _wait_for(path: Path, seconds: float, logs: list[Path]) -> None:
    """metrics.json is the ServerApp's last write (atomic): the run's outputs are complete."""
    deadline = time.time() + seconds
    while not path.exists() and time.time() < deadline:
        time.sleep(0.5)
    if not path.exists():
        tails = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in logs if p.exists())
        pytest.fail(f"no {path.name} after {seconds:.0f}s\n{tails}")


def _connect(port: int, seconds: float) -> socket.socket:
    """A connection to the SuperLink's port once it listens (it takes seconds to start):
    SuperNodes started after that connect at once instead of backing off."""
    deadline = time.time() + seconds
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)


def _check_outputs(out: Path, rounds: int, tmp_path: Path) -> None:
    rows = list(csv.DictReader(open(out / "rounds.csv")))
    assert [int(r["round"]) for r in rows] == list(range(1, rounds + 1))
    assert not any("client" in col for col in rows[0])  # counts stay in the operator log
    for i in range(2):  # every SuperNode trained (client counts are not released)
        assert "train" in (tmp_path / f"supernode{i}.log").read_text().lower()
    assert 0 < float(rows[-1]["epsilon"]) <= 8.0 * (1 + 1e-6)
    assert json.loads((out / "metrics.json").read_text())["rounds"] == rounds


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> str:
    """A tiny random BERT: what is under test is the deployment (processes, connections,
    TLS, authentication, outputs), which does not depend on the model's size; every
    ClientApp process loads it (the bundled MiniLM runs in tests/federated/test_cli.py)."""
    return str(save_tiny_random_model(tmp_path_factory.mktemp("bert"), arch="bert"))


def _needs(*tools: str) -> None:
    if not (BIN / "flower-superlink").exists():
        pytest.skip("flwr CLI not installed (pip install 'dpfit[flwr]')")
    for tool in tools:
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not found on PATH; the secure recipe makes its files with it")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_flwr_run_on_local_superlink_and_two_supernodes(tmp_path, bert):
    _needs()
    home, port, out = tmp_path / "flwr_home", _free_port(), tmp_path / "out"
    _connection(home, port, None)
    env = _env(home)
    _write_app(
        tmp_path / "app",
        ["--model", bert, "--method", "lac", "--clients", "2", "--clients-per-round", "2",
         "--rounds", "2", "--vote-noise", "2", "--examples-per-client", "8",
         "--eval-examples", "32", "--max-length", "32", "--output", str(out)],
    )  # fmt: skip
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
        _connect(port, seconds=60).close()
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
        _sh([str(BIN / "flwr"), "run", str(tmp_path / "app"), "deploy"], env)
        logs = [tmp_path / n for n in ("superlink.log", "supernode0.log", "supernode1.log")]
        _wait_for(out / "metrics.json", 360, logs)
        _check_outputs(out, 2, tmp_path)
    finally:
        _stop(procs[::-1])
    assert all(p.poll() is not None for p in procs)


def _certificates(d: Path) -> tuple[Path, Path, Path]:
    """A local CA, and a SuperLink certificate it signs for 127.0.0.1 / localhost (openssl)."""
    ca, ca_key = d / "ca.crt", d / "ca.key"
    cert, key, csr, ext = d / "server.pem", d / "server.key", d / "server.csr", d / "san.ext"
    _sh(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30",
         "-subj", "/CN=dpfit test CA", "-keyout", str(ca_key), "-out", str(ca)])  # fmt: skip
    _sh(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1",
         "-keyout", str(key), "-out", str(csr)])  # fmt: skip
    ext.write_text("subjectAltName = IP:127.0.0.1, DNS:localhost\n")
    _sh(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
         "-CAcreateserial", "-days", "30", "-extfile", str(ext), "-out", str(cert)])  # fmt: skip
    return ca, cert, key


def _tls_handshake(port: int, ca: Path, seconds: float) -> None:
    """Wait for the SuperLink, then check that it serves TLS that verifies against ``ca``."""
    ctx = ssl.create_default_context(cafile=str(ca))
    with _connect(port, seconds) as raw, ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
        assert tls.version() in ("TLSv1.2", "TLSv1.3")


def _node_key(d: Path, name: str) -> Path:
    """An ECDSA P-384 key pair in OpenSSH format: name (private) and name.pub (registered)."""
    key = d / name
    _sh(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-C", name, "-f", str(key)])
    return key


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_secure_deployment_tls_and_supernode_authentication(tmp_path, bert):
    _needs("openssl", "ssh-keygen")
    home, port, out = tmp_path / "flwr_home", _free_port(), tmp_path / "out"
    certs = tmp_path / "certs"
    certs.mkdir()
    ca, cert, key = _certificates(certs)
    node_keys = [_node_key(certs, f"node{i}") for i in range(2)]
    stranger = _node_key(certs, "stranger")  # never registered
    _connection(home, port, ca)
    env = _env(home)
    # the shortest run that trains on both SuperNodes: one round, no vote
    _write_app(
        tmp_path / "app",
        ["--model", bert, "--method", "fixed", "--clients", "2", "--clients-per-round", "2",
         "--rounds", "1", "--examples-per-client", "8", "--eval-examples", "16",
         "--max-length", "24", "--output", str(out)],
    )  # fmt: skip
    flwr = str(BIN / "flwr")
    procs: list[subprocess.Popen] = []
    try:
        procs.append(
            _start(
                [
                    str(BIN / "flower-superlink"),
                    "--ssl-ca-certfile", str(ca), "--ssl-certfile", str(cert),
                    "--ssl-keyfile", str(key), "--enable-supernode-auth",
                    "--disable-runtime-dependency-installation",
                    "--host", "127.0.0.1", "--port", str(port),
                    "--database", str(tmp_path / "state.db"),
                ],
                tmp_path / "superlink.log",
                env,
            )
        )  # fmt: skip
        # the SuperLink speaks TLS, with the certificate our CA signed for 127.0.0.1
        _tls_handshake(port, ca, seconds=60)
        for k in node_keys:
            _sh([flwr, "supernode", "register", f"{k}.pub", "deploy"], env)
        for i, (name, k) in enumerate([("supernode0", node_keys[0]), ("supernode1", node_keys[1]),
                                       ("stranger", stranger)]):  # fmt: skip
            procs.append(
                _start(
                    [
                        str(BIN / "flower-supernode"), "--root-certificates", str(ca),
                        "--superlink", f"127.0.0.1:{port}",
                        "--auth-supernode-private-key", str(k),
                        "--port", str(_free_port()),
                        "--node-config", f"partition-id={i % 2} num-partitions=2",
                    ],
                    tmp_path / f"{name}.log",
                    env,
                )
            )  # fmt: skip
        _sh([flwr, "run", str(tmp_path / "app"), "deploy"], env)
        logs = [tmp_path / f"{n}.log" for n in ("superlink", "supernode0", "supernode1")]
        _wait_for(out / "metrics.json", 480, logs)
        _check_outputs(out, 1, tmp_path)
        assert REFUSED in (tmp_path / "superlink.log").read_text()
        assert "SuperNode ID" not in (tmp_path / "stranger.log").read_text()
    finally:
        _stop(procs[::-1])
    assert all(p.poll() is not None for p in procs)

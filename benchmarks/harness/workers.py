"""One measurement per fresh process: the worker prints its result as the last line of its
standard output, as JSON, and the driver reads that line (whatever the worker logged before)."""

from __future__ import annotations

import json
import subprocess


def last_json_line(stdout: str) -> dict:
    """The result a worker printed last."""
    return json.loads(stdout.strip().splitlines()[-1])


def run_json_worker(cmd: list[str], env: dict[str, str], label: str = "") -> dict:
    """Run `cmd` and return its result; a failed worker stops the benchmark with the end of
    its stderr (`label` says which one)."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"worker failed{label}:\n{proc.stderr[-3000:]}")
    return last_json_line(proc.stdout)

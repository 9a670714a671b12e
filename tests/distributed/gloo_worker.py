"""The rank side of conftest.launch for the gloo workers: join the job, run each named
scenario once, save the results for the test to read."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist

# a scenario: (world size, its ":"-separated arguments) -> what the test reads back
Scenario = Callable[[int, list[str]], object]


def run_scenarios(argv: list[str], scenarios: Mapping[str, Scenario], timeout_s: float) -> None:
    """argv: rank, world, port, output folder, then scenario specs "name:arg:arg"."""
    rank, world, port, out = int(argv[0]), int(argv[1]), int(argv[2]), Path(argv[3])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    results = {}
    for spec in argv[4:]:
        name, *args = spec.split(":")
        if name not in scenarios:
            raise SystemExit(f"unknown scenario {name}")
        results[spec] = scenarios[name](world, args)
    torch.save(results, out / f"rank{rank}.pt")
    dist.destroy_process_group()

"""Scenarios run by each rank of a gloo job (and, with world size 1, in the test process).

Run as `python dist_worker.py RANK WORLD PORT OUT SCENARIO [SCENARIO...]`; every rank writes
its results to OUT/rank{RANK}.pt. Each scenario is a function of `world` (1 = no group).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from gloo_worker import run_scenarios
from torch import nn
from toy_data import Points

import dpfit
from dpfit import checkpoint as ckpt
from dpfit.distributed import is_main_process


def make_model(mode: str = "bias", width: int = 6) -> nn.Module:
    g = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    if mode == "bias":
        dpfit.make_bias_trainable(model)
    return model


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def trainable_params(model: nn.Module) -> torch.Tensor:
    return torch.cat(
        [p.detach().reshape(-1).clone() for p in model.parameters() if p.requires_grad]
    )


def _wrap(model: nn.Module, ddp: bool, world: int) -> nn.Module:
    if ddp and world > 1:
        return nn.parallel.DistributedDataParallel(model)
    return model


def update(world: int, mode: str, ddp: bool) -> dict:
    """sigma=0, q=1 (a fixed logical batch of all 13 examples), 3 SGD steps; physical batches
    of 3, so rank 0 (7 examples) runs 3 physical batches and rank 1 (6 examples) only 2."""
    model = make_model(mode)
    wrapped = _wrap(model, ddp, world)
    data = Points(13)
    engine = dpfit.PrivacyEngine(
        wrapped, expected_batch_size=13, sample_size=13, noise_multiplier=0.0, mode=mode
    )
    opt = torch.optim.SGD(engine.parameters(), lr=0.5)
    loader = engine.data_loader(data, physical_batch_size=3)
    for _ in range(3):  # q = 1: one logical step per pass
        for x, y, _ in loader:
            nn.functional.cross_entropy(wrapped(x), y).backward()
            engine.step(opt)
    return {"params": flat_params(model), "steps": engine.steps_taken}


def noise(world: int, epochs: int = 12) -> dict:
    """Zero gradients, sigma=1, R=1, B=16, lr=1: each released update is pure noise, std 1/16.
    Also records which examples each logical step drew (for the Poisson-union test)."""
    model = make_model("bias", width=200)
    data = Points(64)
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=16, sample_size=64, noise_multiplier=1.0, max_grad_norm=1.0
    )
    opt = torch.optim.SGD(engine.parameters(), lr=1.0)
    loader = engine.data_loader(data, physical_batch_size=5)
    deltas, current = [], []
    drawn: dict[int, list[int]] = {}  # logical step -> this rank's examples
    prev, prev_steps = trainable_params(model), 0

    def observe() -> None:
        nonlocal prev, prev_steps
        k = engine.steps_taken - prev_steps
        if k:
            now = trainable_params(model)
            deltas.append((now - prev) / k**0.5)  # k noise draws summed: same std after / sqrt(k)
            prev, prev_steps = now, engine.steps_taken

    for _ in range(epochs):
        for x, _y, idx in loader:
            observe()  # empty logical batches step inside the loader
            current.extend(idx.tolist())
            (model(x) * 0.0).sum().backward()
            if engine.step(opt):
                drawn[engine.steps_taken] = current
                current = []
            observe()
    observe()
    return {
        "deltas": torch.stack(deltas),
        "params": trainable_params(model),
        "epsilon": engine.epsilon(),
        "steps": engine.steps_taken,
        "drawn": drawn,
        "record": engine.privacy_record(),
    }


def streams(world: int, secure: bool = False) -> dict:
    """20 draws of this rank's part: insecure_seed=5 on every rank (comparable with one
    process), or secure_rng (rank 0's os.urandom draw shared)."""
    engine = dpfit.PrivacyEngine(
        make_model(),
        expected_batch_size=32,
        sample_size=64,
        noise_multiplier=1.0,
        insecure_seed=None if secure else 5,
        secure_rng=secure,
    )
    sampler = engine.data_loader(Points(64)).sampler
    return {"draws": [sampler.draw() for _ in range(20)]}


def resumed_streams(world: int, state_path: str) -> dict:
    """Resume from a checkpoint of one process (it holds ITS sampler state) on every rank, then
    20 draws of this rank's part."""
    engine = dpfit.PrivacyEngine(
        make_model(), expected_batch_size=32, sample_size=64, noise_multiplier=1.0,
        insecure_seed=5,
    )  # fmt: skip
    engine.load_state_dict(torch.load(state_path, weights_only=False))
    loader = engine.data_loader(Points(64))
    loader.load_state_dict(torch.load(state_path, weights_only=False)["loader"])  # as the CLI does
    return {"draws": [loader.sampler.draw() for _ in range(20)]}


def run_until(world: int, ckdir: str, total: int, die_at: int | None = None) -> dict:
    """q=1, sigma=1: checkpoint (rank 0, atomic) after every logical step; resume from the
    newest checkpoint if there is one; rank 1 dies (os._exit) after step `die_at`."""
    model = make_model("bias")
    data = Points(12)
    engine = dpfit.PrivacyEngine(
        model, expected_batch_size=12, sample_size=12, noise_multiplier=1.0
    )
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    latest = ckpt.latest_checkpoint(ckdir)
    if latest is not None:
        state = torch.load(latest, weights_only=False)
        with torch.no_grad():
            for p, v in zip(engine.parameters(), state["params"], strict=True):
                p.copy_(v)
        opt.load_state_dict(state["optimizer"])
        engine.load_state_dict(state["engine"])
    loader = engine.data_loader(data, physical_batch_size=4)
    while engine.steps_taken < total:
        for x, y, _ in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            if not engine.step(opt):
                continue
            if is_main_process():
                state = {
                    "params": [p.detach().clone() for p in engine.parameters()],
                    "optimizer": opt.state_dict(),
                    "engine": engine.state_dict(),
                }
                ckpt.save_checkpoint(ckdir, engine.steps_taken, state)
            if die_at is not None and engine.steps_taken == die_at and dist.get_rank() == 1:
                os._exit(3)
            if engine.steps_taken >= total:
                break
    return {"epsilon": engine.epsilon(), "steps": engine.steps_taken}


def main(argv: list[str]) -> None:
    run_scenarios(
        argv,
        {
            "update": lambda world, args: update(world, args[0], args[1] == "ddp"),
            "streams": lambda world, args: streams(
                world, secure=bool(args) and args[0] == "secure"
            ),
            "resumed_streams": lambda world, args: resumed_streams(world, args[0]),
            "noise": lambda world, args: noise(world),
            "kill": lambda world, args: run_until(
                world, args[0], int(args[1]), die_at=int(args[2])
            ),
        },
        timeout_s=20,
    )


if __name__ == "__main__":
    main(sys.argv[1:])

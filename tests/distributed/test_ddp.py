"""DistributedDataParallel around the model: its own gradient all-reduce must never reach the
step. Runs in this process on a 1-rank gloo group (DDP needs a group; the engine's checks on
the wrapper do not depend on the world size)."""

from __future__ import annotations

import dist_worker
import pytest
import torch
import torch.distributed as dist
from conftest import free_port
from torch import nn

import dpfit
from dpfit.distributed import no_forward_buffer_sync
from dpfit.errors import DistributedError


@pytest.fixture
def group():
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_backward_with_ddp_sync_on_is_refused(group):
    ddp = nn.parallel.DistributedDataParallel(dist_worker.make_model())
    engine = dpfit.PrivacyEngine(
        ddp, expected_batch_size=4, sample_size=16, noise_multiplier=1.0, sampling="user-poisson"
    )
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    data = dist_worker.Points(4)
    x, y = data.x, data.y
    nn.functional.cross_entropy(ddp(x), y).backward()  # DDP averages raw gradients here
    with pytest.raises(DistributedError, match="no_sync"):
        engine.step(opt, batch_size=4)
    opt.zero_grad()
    with ddp.no_sync():
        nn.functional.cross_entropy(ddp(x), y).backward()
        assert engine.step(opt, batch_size=4)


def test_engine_loader_keeps_ddp_sync_off(group):
    ddp = nn.parallel.DistributedDataParallel(dist_worker.make_model())
    engine = dpfit.PrivacyEngine(ddp, expected_batch_size=8, sample_size=16, noise_multiplier=1.0)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    for x, y, _ in engine.data_loader(dist_worker.Points(16), physical_batch_size=3):
        assert not ddp.require_backward_grad_sync
        nn.functional.cross_entropy(ddp(x), y).backward()
        engine.step(opt)
    assert ddp.require_backward_grad_sync  # restored after the loop
    assert engine.steps_taken == 2
    assert "0.bias" in engine.privacy_record()["trained_parameters"]  # inner names


def test_ddp_broadcasting_buffers_every_forward_is_refused(group):
    model = dist_worker.make_model()
    model.register_buffer("scale", torch.ones(1))
    with pytest.raises(DistributedError, match="forward_sync_buffers=False"):
        dpfit.PrivacyEngine(
            nn.parallel.DistributedDataParallel(model),
            expected_batch_size=4,
            sample_size=16,
            noise_multiplier=1.0,
        )
    dpfit.PrivacyEngine(
        nn.parallel.DistributedDataParallel(model, **no_forward_buffer_sync()),
        expected_batch_size=4,
        sample_size=16,
        noise_multiplier=1.0,
    )

"""Data-parallel DP-SGD over torch.distributed: what the engine needs from a process group.

Every rank draws the same Poisson sample of the whole dataset (from a stream seeded by rank 0)
and keeps every world-th example of it, each rank clips its part into a local sum, and ONE
all-reduce (SUM) per logical step adds the ranks' sums. The Gaussian noise is drawn on rank 0
only and added to rank 0's local sum before that reduce, so the global sum carries it exactly
once, and every rank receives the same reduced tensor (hence bit-identical parameters).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dpfit.errors import DistributedError
from dpfit.rng import secure_seed

log = logging.getLogger(__name__)

__all__ = [
    "DistContext",
    "all_reduce_sum",
    "broadcast_module",
    "no_forward_buffer_sync",
    "stop_forward_buffer_sync",
    "check_identical",
    "init_from_env",
    "is_main_process",
    "launch_command",
    "resolve",
    "share_from_main",
    "shared_seed",
    "unwrap_ddp",
]


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if _active() else 0


def get_world_size() -> int:
    return dist.get_world_size() if _active() else 1


def is_main_process() -> bool:
    """True on rank 0 (and when torch.distributed is not in use): the one that prints/writes."""
    return get_rank() == 0


@dataclass(frozen=True)
class DistContext:
    """The process group the engine reduces over, and this process's place in it."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve(process_group: dist.ProcessGroup | None) -> DistContext | None:
    """The group to use: the given one, else the default one when initialised with >1 rank."""
    if process_group is None and not _active():
        return None
    if not _active():
        raise DistributedError(
            "process_group= was given but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group first (torchrun does the rendezvous)"
        )
    world = dist.get_world_size(process_group)
    if world == 1:
        return None
    return DistContext(process_group, dist.get_rank(process_group), world)


def _main_rank(ctx: DistContext) -> int:
    return dist.get_global_rank(ctx.group, 0) if ctx.group else 0


def _comm_device(ctx: DistContext) -> torch.device:
    """Where this backend's collectives take their tensors (NCCL: the current GPU only)."""
    if dist.get_backend(ctx.group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shared_seed(ctx: DistContext) -> int:
    """A seed from rank 0's os.urandom, the same on every rank: the Poisson sampler's common
    stream (every rank draws the same global sample and keeps its part of it)."""
    value = secure_seed() if ctx.is_main else 0
    seed = torch.tensor([value], dtype=torch.int64, device=_comm_device(ctx))
    dist.broadcast(seed, src=_main_rank(ctx), group=ctx.group)
    return int(seed.item())


def share_from_main(indices: torch.Tensor | None, ctx: DistContext) -> torch.Tensor:
    """Rank 0's index tensor on every rank (others pass None): its length, then its values."""
    device = _comm_device(ctx)
    size = torch.tensor([0 if indices is None else indices.numel()], device=device)
    dist.broadcast(size, src=_main_rank(ctx), group=ctx.group)
    n = int(size.item())
    out = indices.to(device) if ctx.is_main else torch.empty(n, dtype=torch.int64, device=device)
    if n:
        dist.broadcast(out, src=_main_rank(ctx), group=ctx.group)
    return out.cpu()


def all_reduce_sum(tensors: list[torch.Tensor], ctx: DistContext) -> list[torch.Tensor]:
    """Sum each tensor over the ranks in ONE collective (flattened into one float buffer; a
    single contiguous tensor is reduced in place, without a copy)."""
    if not tensors:
        return []
    if len(tensors) == 1 and tensors[0].is_contiguous():
        dist.all_reduce(tensors[0], op=dist.ReduceOp.SUM, group=ctx.group)
        return [tensors[0]]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=ctx.group)
    out, offset = [], 0
    for t in tensors:
        out.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return out


def check_identical(params: list[torch.Tensor], ctx: DistContext) -> None:
    """Refuse to start when ranks hold different trainable parameters (e.g. a head initialised
    from different seeds): their updates would silently diverge."""
    if not params:
        return
    flat = torch.cat([p.detach().reshape(-1).double() for p in params])
    ref = flat.clone()
    dist.broadcast(ref, src=_main_rank(ctx), group=ctx.group)
    bad = torch.tensor([float(not torch.equal(flat, ref))], device=flat.device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=ctx.group)
    if bad.item():
        raise DistributedError(
            "the trainable parameters differ between ranks; initialise them identically (same "
            "seed for the head, or wrap the model in DistributedDataParallel, which broadcasts "
            "rank 0's parameters) before building the PrivacyEngine"
        )


def broadcast_module(module: nn.Module, ctx: DistContext) -> None:
    """Give every rank rank 0's parameters and buffers, as DDP does when it wraps a model (for
    integrations that build the engine before their framework wraps the model)."""
    src = _main_rank(ctx)
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=src, group=ctx.group)


def _has_forward_sync_buffers() -> bool:
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters


def no_forward_buffer_sync() -> dict[str, bool]:
    """DistributedDataParallel keyword arguments that turn off its buffer broadcast in every
    forward: `forward_sync_buffers=False` where torch has it (`broadcast_buffers` is
    deprecated there), `broadcast_buffers=False` on older torch."""
    if _has_forward_sync_buffers():
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def stop_forward_buffer_sync(ddp: nn.Module) -> None:
    """The same switch on a wrapper built elsewhere (transformers' Trainer builds its own and
    knows only the deprecated `broadcast_buffers` argument): DDP reads this flag at each
    forward, and syncs buffers once at construction either way."""
    name = "forward_sync_buffers" if hasattr(ddp, "forward_sync_buffers") else "broadcast_buffers"
    setattr(ddp, name, False)


def unwrap_ddp(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """(the inner module, the DDP wrapper or None). DDP buffers broadcast in every forward is a
    collective the ranks would call a different number of times, so it is refused."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return model, None
    inner = model.module
    syncs = getattr(model, "forward_sync_buffers", getattr(model, "broadcast_buffers", True))
    if syncs and any(True for _ in inner.buffers()):
        raise DistributedError(
            "the DistributedDataParallel model broadcasts buffers in every forward, a "
            "collective that ranks with different numbers of physical batches would call a "
            "different number of times; wrap it with forward_sync_buffers=False "
            "(broadcast_buffers=False before torch 2.13; "
            "dpfit.distributed.no_forward_buffer_sync() gives the right one); buffers of a "
            "fine-tuned model do not change"
        )
    return inner, model


def no_sync_context(ddp: nn.Module | None) -> Callable[[], contextlib.AbstractContextManager]:
    """A context for each physical batch's forward+backward: DDP's own gradient all-reduce
    off (the engine reduces clipped sums itself), a no-op without DDP."""
    if ddp is None:
        return contextlib.nullcontext
    return ddp.no_sync  # type: ignore[return-value]


def init_from_env(backend: str | None = None) -> bool:
    """Initialise the default group from torchrun's environment (WORLD_SIZE > 1); returns
    whether this process is part of a multi-process job."""
    if _active():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    log.info(
        "torch.distributed: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend
    )
    return True


def launched_by_torchrun() -> bool:
    """True inside a process that torchrun (torch.distributed.run) started."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def strip_option(argv: list[str], option: str) -> list[str]:
    """argv without `option VALUE` / `option=VALUE` (the launcher's own option)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def launch_command(nproc_per_node: int, argv: list[str]) -> list[str]:
    """torchrun's argument list running `python -m dpfit <argv>` on nproc_per_node processes
    (single node; for several machines run torchrun yourself with --nnodes/--rdzv-*)."""
    return [f"--nproc-per-node={nproc_per_node}", "-m", "dpfit", *argv]


def launch(nproc_per_node: int, argv: list[str]) -> int:
    """Re-run this command through torch.distributed.run (torchrun) and return its status."""
    from torch.distributed import run as torchrun

    args = launch_command(nproc_per_node, argv)
    log.info("launching: %s -m torch.distributed.run %s", sys.executable, " ".join(args))
    try:
        torchrun.main(args)
    except Exception as e:  # torchrun's ChildFailedError carries the failing rank's trace
        log.error("distributed run failed: %s", e)
        return 1
    return 0

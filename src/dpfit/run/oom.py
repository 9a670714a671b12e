"""An out-of-memory error turned into one that names the flag to change."""

from __future__ import annotations

import contextlib

import torch

from dpfit.errors import DPFitError
from dpfit.run.config import TrainConfig


class PhysicalBatchMemoryError(DPFitError, MemoryError):
    """A physical batch did not fit in memory."""


def is_oom(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    msg = str(e).lower()
    return isinstance(e, RuntimeError) and (
        "out of memory" in msg or "can't allocate memory" in msg or "not enough memory" in msg
    )


def oom_error(config: TrainConfig, e: BaseException) -> PhysicalBatchMemoryError:
    smaller = max(1, config.physical_batch_size // 2)
    text = config.task != "image-classification"  # images have no max length to lower
    return PhysicalBatchMemoryError(
        f"a physical batch of up to {config.physical_batch_size} examples"
        + (f" (max length {config.max_length})" if text else "")
        + f" did not fit in memory; retry with --physical-batch-size {smaller} (the logical "
        "batch and the privacy guarantee stay the same)"
        + (" or a smaller --max-length" if text else "")
        + f". ({type(e).__name__}: {str(e)[:200]})"
    )


@contextlib.contextmanager
def oom_guard(config: TrainConfig):
    """Turn an out-of-memory error into one that says which flag to change."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if is_oom(e):
            raise oom_error(config, e) from e
        raise

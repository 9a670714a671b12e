"""Tensor memory of a call, as torch's allocator sees it (the C library's caching aside): how
the tests and benchmarks check that the private path holds no more than the non-private one."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

from torch.profiler import ProfilerActivity, profile


def tensor_peak(fn: Callable[[], object]) -> int:
    """The most bytes of tensors allocated during `fn()` that are live at once (tensors from
    before the call are not counted), from the profiler's CPU memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return max([0, *(e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]")])


# glibc's mallopt parameter: blocks at least this large get their own mmap
_M_MMAP_THRESHOLD = -3


def return_freed_memory(threshold: int = 1 << 20) -> bool:
    """Ask glibc's malloc to give every block of `threshold` bytes or more its own mapping, so
    that a freed tensor's pages go back to the system at once.

    Why: by default glibc raises that threshold to the largest block freed so far (up to 32
    MiB), after which activation-sized tensors come from the heap, and the heap keeps freed
    pages mapped: at long T, a bias-only step's resident memory then ends up about twice its
    live tensors (benchmarks/results/long_context.md). Costs a page fault per page of each new
    large tensor. Process-wide and permanent, so only programs call it (dpfit train with
    --activation-checkpointing), never the library. False where there is no glibc.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))

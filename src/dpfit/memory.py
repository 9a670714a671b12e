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

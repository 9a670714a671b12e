"""Resident-set probes for a worker process that measures one arm: what it holds now, the
peak since the last reset, and the reset (Linux's clear_refs; elsewhere the process's
lifetime peak, which can over-state a step's peak when loading peaked higher)."""

from __future__ import annotations

import os
import sys


def rss_now() -> int:
    """Bytes resident now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil

        return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Reset the peak that `peak_rss` reads; False where the system cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss(resettable: bool = True) -> int:
    """Peak resident bytes: since the last reset when `resettable` (VmHWM), else over the
    process's life (ru_maxrss)."""
    if resettable:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024

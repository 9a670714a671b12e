"""How many CPU threads torch uses (``--threads``): all, or one when the machine is busy."""

from __future__ import annotations

import logging
import os

from dpfit.errors import DPFitError

logger = logging.getLogger(__name__)


def set_threads(spec: str) -> None:
    import torch

    if spec == "auto":
        try:
            busy = os.getloadavg()[0] >= (os.cpu_count() or 1)
        except OSError:  # pragma: no cover - no load average on this platform
            busy = False
        if busy and torch.get_num_threads() > 1 and "OMP_NUM_THREADS" not in os.environ:
            logger.info("CPUs busy (load average >= cores): using 1 torch thread")
            torch.set_num_threads(1)
        return
    try:
        n = int(spec)
    except ValueError:
        raise DPFitError(f"--threads must be a number or auto, got {spec!r}") from None
    if n < 1:
        raise DPFitError(f"--threads must be >= 1, got {n}")
    torch.set_num_threads(n)

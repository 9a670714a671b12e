"""Where a run writes, checked before it spends any privacy.

A private run spends budget that cannot be spent again, so every folder it will write to is
validated and created before any data is read (a typo found after training would lose the
result), and a folder holding an earlier run is never silently overwritten. When a write
fails after training anyway, :func:`fallback_dir` names a folder that takes what is left.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from pathlib import Path

from dpfit.errors import DPFitError

logger = logging.getLogger(__name__)

RUNS_ROOT = "runs"  # default parent of run folders, relative to the working directory
RUNS_ROOT_ENV = "DPFIT_RUNS_DIR"  # overrides RUNS_ROOT (e.g. a scratch disk, or tests)


def runs_root() -> Path:
    """Where default run folders go: $DPFIT_RUNS_DIR, else ./runs."""
    return Path(os.environ.get(RUNS_ROOT_ENV) or RUNS_ROOT)


RUN_RECORD = "metrics.json"  # a folder holding this holds a run (finished or failed)


class OutputError(DPFitError, OSError):
    """An output folder cannot be used, or a write failed; the message says what to do."""


def default_run_dir(task: str, root: str | Path | None = None, now: float | None = None) -> Path:
    """A new folder name ROOT/<task>-<YYYYmmdd-HHMMSS>[-k] (ROOT: runs_root()), not on disk."""
    root = runs_root() if root is None else root
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    base = Path(root) / f"{task}-{stamp}"
    path, k = base, 2
    while path.exists():
        path = base.with_name(f"{base.name}-{k}")
        k += 1
    return path


def _writable(folder: Path, flag: str) -> None:
    probe = folder / f".dpfit-write-check-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OutputError(
            f"{flag} {folder}: cannot write there ({e.strerror or e}); name a folder you can "
            "write to"
        ) from None


def prepare_dir(path: str | Path, flag: str) -> Path:
    """Create `path` (a folder, with parents) and check it is writable; OutputError if not."""
    folder = Path(path)
    if folder.exists() and not folder.is_dir():
        raise OutputError(
            f"{flag} {folder} is an existing file, not a folder; name a new folder, e.g. "
            f"{flag} {folder.with_suffix('')}-run"
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(
            f"{flag} {folder}: cannot create the folder ({e.strerror or e}); name a folder "
            "you can write to"
        ) from None
    _writable(folder, flag)
    return folder


def check_output_dir(path: str | Path, resume: bool) -> Path:
    """The --output folder, created; refuses one that already holds a run's record unless
    the run is being resumed (then it is the same run, finishing)."""
    folder = Path(path)
    record = folder / RUN_RECORD
    if record.is_file() and not resume:
        raise OutputError(
            f"--output {folder} already holds a run ({record}); name a new folder, or move "
            "that one away, so its record is not overwritten"
        )
    return prepare_dir(folder, "--output")


def fallback_dir(output: str | Path | None, task: str) -> Path:
    """A folder to save what a failed write left: next to the working directory's runs/, else
    the system temporary folder. Always a new folder."""
    stem = f"rescued-{Path(output).name}" if output else task
    for root in (runs_root(), Path(tempfile.gettempdir()) / "dpfit-runs"):
        candidate = default_run_dir(stem, root)
        try:
            return prepare_dir(candidate, "fallback")
        except OutputError:
            continue
    return Path(tempfile.mkdtemp(prefix="dpfit-rescued-"))

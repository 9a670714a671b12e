"""Result logs as JSON lines: one finished run a line, appended as it finishes, so a stopped
benchmark keeps what it measured and resumes by skipping what the log already holds."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a log (blank lines skipped); none when the log does not exist yet."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def append_jsonl(path: Path, row: dict, durable: bool = False) -> None:
    """Append one record (the folder made if missing); `durable` waits for the disk, for
    runs long enough that losing the last line to a crash would cost a rerun."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
        if durable:
            f.flush()
            os.fsync(f.fileno())

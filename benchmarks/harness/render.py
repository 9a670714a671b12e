"""Write a benchmark's generated block into a docs page, between its begin/end markers, so the
hand-written prose around it stays and the figures inside come only from the script."""

from __future__ import annotations

from pathlib import Path


def write_between_markers(path: Path, markers: tuple[str, str], block: str) -> None:
    """Replace what lies between `markers` in `path` with `block` (the markers stay)."""
    body = path.read_text()
    begin, end = markers
    if begin not in body or end not in body:
        raise SystemExit(f"{path} has no {begin} ... {end} markers")
    head, rest = body.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{block}\n{end}{tail}")

"""benchmarks/README.md is the index of the benchmarks: every script in benchmarks/ (not the
harness, not the archive) has a row, every archived probe has one in the archive's README, and
every link in either page points at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from benchmark_scripts import BENCHMARKS

LINK = re.compile(r"\]\(([^)\s]+)\)")
PAGES = [BENCHMARKS / "README.md", BENCHMARKS / "archive" / "README.md"]


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]


def _scripts(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.py"))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_every_script_in_the_folder_has_a_link_in_its_index(page):
    linked = {Path(t.split("#")[0]).name for t in _links(page)}
    missing = [s for s in _scripts(page.parent) if s not in linked]
    assert not missing, f"add a row for {missing} to {page} (or archive the script)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(BENCHMARKS)))
def test_every_link_in_the_index_exists(page):
    broken = [t for t in _links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert not broken, f"{page} links to files that do not exist: {broken}"


def test_the_index_covers_the_scripts_and_not_the_harness():
    scripts = _scripts(BENCHMARKS)
    assert "utility.py" in scripts and "__init__.py" not in scripts  # the harness is a folder
    assert _scripts(BENCHMARKS / "archive"), "the archive's probes are listed on its own page"

"""docs/long_documents.md quotes benchmarks/results/long_document_train.md's table as the
script rendered it, not a hand copy."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import long_document_train  # noqa: E402


def test_docs_quote_the_committed_table():
    md = (ROOT / "benchmarks" / "results" / "long_document_train.md").read_text()
    docs = long_document_train.DOCS.read_text()
    begin, end = long_document_train.DOC_MARKERS
    block = docs.split(begin, 1)[1].split(end, 1)[0].strip()
    assert block == long_document_train.docs_table(md.splitlines())
    assert block.count("\n") >= 10  # the whole table

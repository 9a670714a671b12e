"""Kept so that scripts importing ``doc_block`` (utility, federated_lac) still run; the writer
lives in harness.render."""

from harness.render import write_between_markers

__all__ = ["write_between_markers"]

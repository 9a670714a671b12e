"""Data loading: the bundled offline assets and the user's own files go through one path."""

from dpfit.data.bundled import (
    BundledAssetMissing,
    TextExample,
    hamlet_lines,
    minilm_path,
    rotten_tomatoes,
    smollm2_gguf,
    split_by_group,
)

__all__ = [
    "BundledAssetMissing",
    "TextExample",
    "hamlet_lines",
    "minilm_path",
    "rotten_tomatoes",
    "smollm2_gguf",
    "split_by_group",
]
